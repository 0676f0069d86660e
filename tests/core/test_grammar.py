"""Constrained decoding: every drafter composes with a grammar and the output does not change."""

from __future__ import annotations

import json
from functools import cache

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from toy_backend import GarbageDrafter, RepeatDrafter, ToyBackend, ToyTokenizer, make_engine, run_requests

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.modelfile.constraint import ConstraintError, GrammarSpec, mask_for_argmax, trim_draft
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.grammar_llg import Grammars
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.verify.sampling import Sampler, dense
from spekula.core.verify.verifier import MatchVerifier, acceptance_probability, residual_distribution

EOS = 47
LETTERS = "abcdefgh"
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 5, "spec-ngram-mod-n-match": 2,
                "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 5}


def toy_tok() -> ToyTokenizer:
    return ToyTokenizer(48, eog_ids=frozenset({EOS}))


# -- random small grammars over a few letters ----------------------------------------------------

def _expr(depth: int) -> st.SearchStrategy[str]:
    literal = st.text(LETTERS, min_size=1, max_size=3).map(lambda s: f'"{s}"')
    if depth == 0:
        return literal
    inner = _expr(depth - 1)
    # A repetition applies to a literal, a sequence or an alternation, never directly to another
    # repetition: llguidance's GBNF reader turns `(("a")*)*` into Lark it cannot parse.
    repeatable = st.one_of(literal, st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + " ".join(xs) + ")"),
                           st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + " | ".join(xs) + ")"))
    return st.one_of(
        literal,
        st.lists(inner, min_size=2, max_size=3).map(" ".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + " | ".join(xs) + ")"),
        st.tuples(repeatable, st.sampled_from(["*", "+", "?", "{1,3}", "{2}"])).map(lambda t: f"({t[0]}){t[1]}"),
    )


GRAMMARS = _expr(2).map(lambda body: f"root ::= {body}")


def _accepts(grammars: Grammars, source: str, tokens: list[int]) -> bool:
    """The tokens (an end-of-generation token ends them) are a sentence, or a prefix cut by n_predict."""
    c = grammars.new(GrammarSpec("gbnf", source))
    body = [t for t in tokens if t != EOS]
    return c.valid_prefix(body) == len(body)


async def _run(types: tuple[str, ...], drafters: list, grammar: str, sampling: SamplingParams, n: int):  # type: ignore[no-untyped-def]
    engine = make_engine(ToyBackend(), toy_tok(), spec=SpecParams(types=types, adaptive=False), drafters=drafters)
    [final] = await run_requests(engine, [CompletionRequest([3, 9, 4, 17, 0, 1, 0, 1], n_predict=n, sampling=sampling,
                                                            grammar=GrammarSpec("gbnf", grammar))])
    assert final.error is None, final.error
    return final, engine


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grammar=GRAMMARS, n=st.integers(1, 24), temperature=st.sampled_from([0.0, 0.9]), seed=st.integers(0, 2**31),
       which=st.sampled_from(["repeat", "garbage", "both"]))
def test_toy_constrained_output_is_the_same_with_every_drafter(grammar: str, n: int, temperature: float, seed: int,
                                                               which: str) -> None:
    sampling = SamplingParams(temperature=temperature, seed=seed)

    async def go() -> None:
        plain, _ = await _run((), [], grammar, sampling, n)
        assert _accepts(Grammars(toy_tok()), grammar, plain.tokens)
        drafters = {"repeat": [RepeatDrafter()], "garbage": [GarbageDrafter(48)],
                    "both": [RepeatDrafter(), GarbageDrafter(48)]}[which]
        types = tuple(d.name for d in drafters)
        spec, engine = await _run(types, drafters, grammar, sampling, n)
        assert spec.tokens == plain.tokens and spec.stop_type == plain.stop_type

    anyio.run(go)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grammar=GRAMMARS, emitted=st.lists(st.integers(0, 47), max_size=6), draft=st.lists(st.integers(0, 47), max_size=8),
       seed=st.integers(0, 2**31), peaked=st.booleans())
def test_greedy_verification_masks_one_row_for_the_same_tokens(grammar: str, emitted: list[int], draft: list[int],
                                                                seed: int, peaked: bool) -> None:
    """mask_for_argmax (a row at most) and mask_logits (every row) give a greedy verifier the same tokens,
    from any reachable grammar state, for drafts the grammar cuts (as the engine trims them)."""
    grammars = Grammars(toy_tok())

    def constraint():  # type: ignore[no-untyped-def]
        c = grammars.new(GrammarSpec("gbnf", grammar))
        c.advance(emitted[: c.valid_prefix(emitted)])
        return c

    full, one = constraint(), constraint()
    d = draft[: full.valid_prefix(draft)]
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((len(d) + 1, 48)).astype(np.float32)
    if peaked:  # rows whose argmax is the draft token, so the draft is accepted deep into it
        for i, t in enumerate(d):
            logits[i, t] += 5.0 * rng.integers(0, 2)
    a, b = logits.copy(), logits.copy()
    full.mask_logits(a, d)
    mask_for_argmax(one, b, d)
    verifier = MatchVerifier(Sampler(SamplingParams(temperature=0.0), 48, 0), lambda t: t == EOS)
    assert verifier.takes_argmax
    expect, got = verifier.verify(d, None, a), verifier.verify(d, None, b)
    assert (got.emitted, got.n_accepted) == (expect.emitted, expect.n_accepted)
    assert full.valid_prefix(got.emitted) == one.valid_prefix(got.emitted)  # the state was left as it was


@pytest.mark.anyio
async def test_forbidden_draft_tokens_are_counted_and_never_verified() -> None:
    grammar = 'root ::= ("ab")+'
    final, engine = await _run(("test-garbage",), [GarbageDrafter(48)], grammar, SamplingParams(temperature=0.0), 20)
    text = toy_tok().decode(final.tokens, skip_special=True)
    assert set(text) <= {"a", "b"} and text.startswith("ab")
    st_ = engine.stats()["drafters"]["test-garbage"]
    assert st_.get("grammar_rejected", 0) > 0
    assert final.timings["draft_n_grammar_rejected"] == st_["grammar_rejected"]
    line = engine.spec_stats.lines()[0]
    assert f"#grammar rejected = {st_['grammar_rejected']}" in line


@pytest.mark.anyio
async def test_grammar_completion_stops_the_request() -> None:
    final, _ = await _run((), [], 'root ::= "abc"', SamplingParams(temperature=0.0), 50)
    assert final.tokens[-1] == EOS and toy_tok().decode(final.tokens, skip_special=True) == "abc"
    assert final.stop_type == "eos"
    # a grammar that can never accept ends at once with nothing generated, never a hang
    final, _ = await _run((), [], 'root ::= root "a"', SamplingParams(temperature=0.0), 50)
    assert final.stop_type == "eos" and toy_tok().decode(final.tokens, skip_special=True) == ""


def test_bad_grammars_and_schemas_say_what_is_wrong() -> None:
    g = Grammars(toy_tok())
    with pytest.raises(ConstraintError, match="foo"):
        g.compile(GrammarSpec("gbnf", "root ::= foo"))
    with pytest.raises(ConstraintError, match="uniqueItems"):
        g.compile(GrammarSpec("json_schema", json.dumps({"type": "array", "uniqueItems": True})))
    with pytest.raises(ConstraintError, match="format"):
        g.compile(GrammarSpec("json_schema", json.dumps({"type": "string", "format": "color"})))


def test_trim_draft_keeps_the_forbidden_token_only_for_rejection_sampling() -> None:
    probs = np.full((4, 3), 1 / 3, np.float32)
    assert trim_draft([1, 2, 3, 4], None, 2) == ([1, 2], None, 2)
    tokens, p, rejected = trim_draft([1, 2, 3, 4], probs, 2)
    assert tokens == [1, 2, 3] and p is not None and p.shape == (3, 3) and rejected == 2
    assert trim_draft([1, 2], None, 2) == ([1, 2], None, 0)


def test_rejection_sampling_under_a_mask_emits_the_masked_target_distribution() -> None:
    """Enumerate one verification row: the draft token x ~ q (unmasked, so possibly forbidden), accept
    with min(1, p(x)/q(x)) under the masked p, else draw from the residual. The emitted token's law
    must be the masked target distribution, forbidden draft tokens included."""
    rng = np.random.default_rng(3)
    n_vocab = 12
    sampler = Sampler(SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0), n_vocab, 0)
    for _ in range(20):
        logits = rng.standard_normal((1, n_vocab)).astype(np.float32) * 2
        allowed = rng.random(n_vocab) < 0.5
        allowed[rng.integers(n_vocab)] = True
        logits[0, ~allowed] = -np.inf
        ids, probs = sampler.distribution(logits[0])
        p = dense(ids, probs, n_vocab)
        q = rng.dirichlet(np.ones(n_vocab))  # the drafter knows nothing of the grammar
        law = np.zeros(n_vocab)
        for x in range(n_vocab):
            a = acceptance_probability(float(p[x]), float(q[x]))
            law[x] += q[x] * a
            r = residual_distribution(p, q)
            if r is not None:
                law += q[x] * (1 - a) * r
        assert np.allclose(law, p, atol=1e-9)
        assert np.all(law[~allowed] == 0)


@cache
def _tiny() -> tuple[str, Tokenizer]:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    path = str(tiny_model_path("llama"))
    return path, Tokenizer.from_gguf(GGUFFile(path))


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(grammar=GRAMMARS, n=st.integers(1, 20), temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 2**31),
       types=st.sampled_from([("ngram-simple",), ("ngram-map-k",), ("ngram-map-k4v",), ("ngram-mod",), ("ngram-cache",),
                              ("suffix",), ("draft-simple",),
                              ("ngram-simple", "ngram-mod", "suffix", "draft-simple"),
                              ("ngram-map-k", "ngram-map-k4v", "ngram-cache", "draft-simple")]),
       backend=st.sampled_from(["native", "torch"]))
def test_tiny_model_constrained_output_is_the_same_with_every_drafter(grammar: str, n: int, temperature: float,
                                                                      seed: int, types: tuple[str, ...],
                                                                      backend: str) -> None:
    path, tok = _tiny()
    sampling = SamplingParams(temperature=temperature, seed=seed)
    spec = GrammarSpec("gbnf", grammar)
    prompt = tok.encode("abc abc abc ab", add_special=True)

    async def run(spec_types: tuple[str, ...]) -> list[int]:
        b = load_backend(backend, path, BackendOptions(n_ctx=128, n_seq_max=1, threads=1))
        # draft-simple drafts with the same tiny model: good drafts, so the grammar's cut is exercised
        engine = make_engine(b, tok, n_ctx=128, spec=SpecParams(types=spec_types, drafter_options=dict(SMALL_NGRAMS)),
                             draft_model_path=path)
        [final] = await run_requests(engine, [CompletionRequest(list(prompt), n_predict=n, sampling=sampling,
                                                                grammar=spec)])
        assert final.error is None, final.error
        engine.close()
        return final.tokens

    plain = anyio.run(run, ())
    assert anyio.run(run, types) == plain
    c = Grammars(tok).new(spec)
    body = [t for t in plain if not tok.is_eog(t)]
    assert c.valid_prefix(body) == len(body)


def _schemas() -> list[dict]:  # type: ignore[type-arg]
    """20 schemas: objects with strings, integers, numbers, booleans, enums, arrays, nested objects."""
    colours = ["red", "green", "blue", "black"]
    out = []
    for i in range(20):
        props: dict = {"name": {"type": "string", "maxLength": 24},  # type: ignore[type-arg]
                       "count": {"type": "integer", "minimum": 0, "maximum": 1000}}
        if i % 2 == 0:
            props["colour"] = {"enum": colours[: 2 + i % 3]}
        if i % 3 == 0:
            props["tags"] = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        if i % 4 == 1:
            props["price"] = {"type": "number"}
        if i % 5 == 2:
            props["owner"] = {"type": "object", "additionalProperties": False, "required": ["first", "age"],
                              "properties": {"first": {"type": "string", "maxLength": 16},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
        if i % 7 == 3:
            props["ok"] = {"type": "boolean"}
        out.append({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
    return out


@pytest.mark.slow
def test_smollm2_json_schemas_validate_with_and_without_speculation() -> None:
    import jsonschema
    from model_drafter_helpers import smollm2_or_skip

    from spekula.core.errors import SpekulaError

    path = str(smollm2_or_skip())
    tok = Tokenizer.from_gguf(GGUFFile(path))
    things = ["a bicycle", "a cat", "a city", "a book", "a song", "a car", "a tree", "a river", "a phone", "a chair"]
    schemas = _schemas()

    async def run(types: tuple[str, ...]) -> list:  # type: ignore[type-arg]
        b = load_backend("native", path, BackendOptions(n_ctx=1024, n_seq_max=1, threads=2))
        engine = make_engine(b, tok, n_ctx=1024, n_batch=256,
                             spec=SpecParams(types=types, drafter_options=dict(SMALL_NGRAMS)))
        out = []
        for i, schema in enumerate(schemas):
            ask = f"Describe {things[i % 10]} as JSON with the fields {', '.join(schema['properties'])}."
            text = tok.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)
            [f] = await run_requests(engine, [CompletionRequest(
                tok.encode(text, add_special=True), n_predict=256, sampling=SamplingParams(temperature=0.0),
                grammar=GrammarSpec("json_schema", json.dumps(schema)))], timeout=300)
            out.append(f)
        engine.close()
        return out

    plain = anyio.run(run, ())
    spec = anyio.run(run, ("ngram-mod", "ngram-simple"))
    for schema, p, s in zip(schemas, plain, spec, strict=True):
        assert p.stop_type == "eos", p.content
        try:
            jsonschema.validate(json.loads(p.content), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            raise SpekulaError(f"{p.content!r} does not validate: {exc}") from None
        assert s.tokens == p.tokens
    assert sum(f.timings.get("draft_n", 0) for f in spec) > 0  # speculation was at work


@pytest.fixture(scope="module")
def tiny_target_and_heads(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from model_drafter_helpers import build_target

    from spekula.backends.convert.hf import convert
    from spekula.fixtures import tiny_hf

    root = tmp_path_factory.mktemp("grammar-heads")
    hf, target = build_target(root)
    e3, df = root / "e3.gguf", root / "df.gguf"
    convert(tiny_hf.write_eagle3(root / "e3-hf", layer_ids=(1, 4, 8)), e3, outtype="f32", target_dir=hf)
    convert(tiny_hf.write_dflash(root / "df-hf", layer_ids=(1, 6), block_size=4), df, outtype="f32", target_dir=hf)
    return target, {"draft-eagle3": e3, "draft-dflash": df}


@pytest.mark.parametrize("drafter", ["draft-eagle3", "draft-dflash"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_hidden_state_drafters_compose_with_grammars(tiny_target_and_heads, drafter: str,  # type: ignore[no-untyped-def]
                                                     temperature: float) -> None:
    """The model drafters fed by the target's hidden states go through the same cut and row masks."""
    from model_drafter_helpers import target_backend

    target, heads = tiny_target_and_heads
    tok = Tokenizer.from_gguf(GGUFFile(target))
    sampling = SamplingParams(temperature=temperature, seed=11)
    prompt = tok.encode("abc abc abc ab", add_special=True)

    async def run(types: tuple[str, ...], grammar: str) -> tuple[list[int], dict]:  # type: ignore[type-arg]
        engine = make_engine(target_backend(target), tok, spec=SpecParams(types=types, n_max=4, adaptive=False),
                             draft_model_path=str(heads[drafter]))
        [final] = await run_requests(engine, [CompletionRequest(list(prompt), n_predict=16, sampling=sampling,
                                                                grammar=GrammarSpec("gbnf", grammar))], timeout=120)
        assert final.error is None, final.error
        return final.tokens, engine.stats()["drafters"]

    for grammar in ('root ::= ("abc" | " ")+', 'root ::= "a" [a-z ]* "."', 'root ::= ("ab" | "b")* "c"'):
        plain, _ = anyio.run(run, (), grammar)
        spec, stats = anyio.run(run, (drafter,), grammar)
        assert spec == plain, grammar
        assert stats[drafter]["calls_draft"] > 0
