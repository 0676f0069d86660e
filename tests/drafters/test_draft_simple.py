"""draft-simple: vocabulary check, drafting rules (cap, p_min, n_min, probabilistic q), one draft
forward per step for all slots, KV kept in step across rounds, and lossless output through the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from toy_backend import ToyBackend, ToyTokenizer, make_engine, plain_decode, run_requests

from spekula.core.drafting.drafter import DrafterContext, DraftRequest
from spekula.core.errors import ConfigError
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.drafters.model.draft_simple import DraftSimpleDrafter, check_vocab_compatible

V = 48
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 9, 4, 17, 5, 8, 2, 11, 3, 9]


# --- vocabulary compatibility ---------------------------------------------------------------------


@dataclass
class FakeVocab:
    texts: list[str] = field(default_factory=lambda: [f"t{i}" for i in range(20)])
    model_kind: str = "gpt2"
    add_bos: bool = False
    add_eos: bool = False
    bos_id: int | None = 1
    eos_id: int | None = 2

    @property
    def n_vocab(self) -> int:
        return len(self.texts)

    def token_text(self, i: int) -> str:
        return self.texts[i]


def check(draft: FakeVocab) -> None:
    check_vocab_compatible(FakeVocab(), draft, "target.gguf", "draft.gguf")


def test_vocab_compatible_cases() -> None:
    check(FakeVocab())
    check(FakeVocab(bos_id=7))  # BOS id matters only when add_bos is set
    texts = [f"t{i}" for i in range(20)]
    texts[4] = "other"  # ids 0-4 are exempt
    check(FakeVocab(texts=texts))
    check(FakeVocab(texts=[f"t{i}" for i in range(20)] + [f"x{i}" for i in range(100)]))  # within 128


@pytest.mark.parametrize(
    ("draft", "needle"),
    [
        (FakeVocab(model_kind="llama"), "vocab type"),
        (FakeVocab(add_bos=True), "BOS differs"),
        (FakeVocab(add_eos=True), "EOS differs"),
        (FakeVocab(texts=[f"t{i}" for i in range(20)] + [f"x{i}" for i in range(129)]), "differ by more than 128"),
        (FakeVocab(texts=[f"t{i}" for i in range(9)] + ["zz"] + [f"t{i}" for i in range(10, 20)]),
         "token 9 differs: target 't9', draft 'zz'"),
    ],
)
def test_vocab_mismatch_names_both_models(draft: FakeVocab, needle: str) -> None:
    with pytest.raises(ConfigError, match="draft model draft.gguf cannot draft for target target.gguf") as ei:
        check(draft)
    assert needle in str(ei.value)


def test_bos_id_checked_when_added() -> None:
    with pytest.raises(ConfigError, match="BOS differs"):
        check_vocab_compatible(FakeVocab(add_bos=True), FakeVocab(add_bos=True, bos_id=3), "t", "d")


def test_create_needs_a_draft_model() -> None:
    ctx = DrafterContext(spec=SpecParams(types=("draft-simple",)), target=ToyBackend(), tokenizer=None, n_seq_max=1)
    with pytest.raises(ConfigError, match="needs a draft model"):
        DraftSimpleDrafter.create(ctx)


def test_create_rejects_vocab_mismatched_gguf() -> None:
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer
    from spekula.fixtures.tiny_gguf import tiny_model_path

    target_path, draft_path = tiny_model_path("llama"), tiny_model_path("qwen2")
    target_tok = Tokenizer.from_gguf(GGUFFile(target_path))
    ctx = DrafterContext(spec=SpecParams(types=("draft-simple",)), target=ToyBackend(n_vocab=target_tok.n_vocab),
                         tokenizer=target_tok, n_seq_max=1, draft_model_path=str(draft_path))
    with pytest.raises(ConfigError) as ei:
        DraftSimpleDrafter.create(ctx)
    msg = str(ei.value)
    assert str(draft_path) in msg and "differs" in msg


# --- drafting rules on the toy backend --------------------------------------------------------------


def request(slot: int, history: list[int], last: int, *, budget: int = 16, temperature: float = 0.0,
            seed: int = 1, **spec: object) -> DraftRequest:
    """`budget` is the round's n_draft_max; `spec` overrides SpecParams (n_max = --spec-draft-n-max)."""
    return DraftRequest(slot=slot, history=np.asarray(history, np.int32), last=last, n_max=budget,
                        spec=SpecParams(types=("draft-simple",)).with_(**spec), temperature=temperature, seed=seed)


def greedy_continuation(backend: ToyBackend, tokens: list[int], n: int) -> list[int]:
    return plain_decode(backend, tokens, n_predict=n, sampling=GREEDY, seed=0, is_eog=lambda t: False, n_ctx=256)


def test_greedy_draft_is_the_draft_models_greedy_continuation() -> None:
    drafter = DraftSimpleDrafter(ToyBackend(), target_n_vocab=V)
    drafter.begin(0, np.asarray(PROMPT[:-1], np.int32))
    (d,) = drafter.draft([request(0, PROMPT[:-1], PROMPT[-1], n_max=4)])
    assert d.tokens == greedy_continuation(ToyBackend(), PROMPT, 4) and d.probs is None


def test_caps_p_min_and_n_min() -> None:
    drafter = DraftSimpleDrafter(ToyBackend(), target_n_vocab=V)
    h, x = PROMPT[:-1], PROMPT[-1]
    assert len(drafter.draft([request(0, h, x, budget=2)])[0].tokens) == 2  # the round budget
    assert len(drafter.draft([request(0, h, x, budget=16)])[0].tokens) == 3  # --spec-draft-n-max default
    assert drafter.draft([request(0, h, x, budget=0)])[0].tokens == []
    assert drafter.draft([request(0, h, x, p_min=1.0)])[0].tokens == []  # top-10 softmax never reaches 1
    assert drafter.draft([request(0, h, x, budget=2, n_min=3)])[0].tokens == []  # discarded, not padded
    # p_min between the steps' top probabilities stops the draft early; the rule is per step.
    full = drafter.draft([request(0, h, x, n_max=8)])[0].tokens
    assert len(full) == 8
    part = drafter.draft([request(0, h, x, p_min=0.5, n_max=8)])[0].tokens
    assert 0 < len(part) < 8 and part == full[: len(part)]


def test_one_forward_per_step_for_all_slots() -> None:
    backend = ToyBackend()
    drafter = DraftSimpleDrafter(backend, target_n_vocab=V)
    reqs = [request(s, PROMPT[: 5 + s], PROMPT[5 + s], n_max=3) for s in range(3)]
    before = backend.n_forward
    drafts = drafter.draft(reqs)
    # catch-up + x, then one forward per further step (the last drafted token is not decoded)
    assert backend.n_forward - before == 3
    assert all(len(d.tokens) == 3 for d in drafts)
    for s, d in enumerate(drafts):
        assert d.tokens == greedy_continuation(ToyBackend(), PROMPT[: 6 + s], 3)


def test_probabilistic_drafting_returns_q_and_is_seeded() -> None:
    def run(seed: int) -> tuple[list[int], np.ndarray]:
        drafter = DraftSimpleDrafter(ToyBackend(), target_n_vocab=V)
        drafter.begin(0, np.asarray(PROMPT[:-1], np.int32))
        d = drafter.draft([request(0, PROMPT[:-1], PROMPT[-1], temperature=1.5, seed=seed,
                                   draft_sampling="probabilistic", n_max=5)])[0]
        assert d.probs is not None
        return d.tokens, d.probs

    tokens, probs = run(7)
    assert probs.shape == (5, V) and probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    assert all(np.count_nonzero(row) <= 10 for row in probs)
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens))
    again, probs2 = run(7)
    assert again == tokens and np.array_equal(probs, probs2)
    assert any(run(s)[0] != tokens for s in range(8, 14))  # the seed matters


def test_probabilistic_p_min_stop_gives_empty_draft() -> None:
    drafter = DraftSimpleDrafter(ToyBackend(), target_n_vocab=V)
    d = drafter.draft([request(0, PROMPT[:-1], PROMPT[-1], temperature=1.0, draft_sampling="probabilistic",
                               p_min=1.0)])[0]
    assert d.tokens == [] and d.probs is None


def test_vocab_beyond_target_is_never_drafted() -> None:
    # A draft model with 20 more tokens: its logits columns >= the target's vocab are ignored.
    drafter = DraftSimpleDrafter(ToyBackend(n_vocab=V + 20, salt=3), target_n_vocab=V)
    for start in range(6):
        d = drafter.draft([request(0, PROMPT[start:-1], PROMPT[-1], n_max=6)])[0]
        assert all(t < V for t in d.tokens)


def test_kv_follows_history_changes() -> None:
    """A rewritten history (rejections, a new request on the slot) is re-synced, never drafted on stale KV."""
    backend = ToyBackend()
    drafter = DraftSimpleDrafter(backend, target_n_vocab=V)
    drafter.draft([request(0, PROMPT[:-1], PROMPT[-1])])
    other = [7, 7, 1, 30, 22, 4, 4, 9]
    d = drafter.draft([request(0, other[:-1], other[-1])])[0]
    assert d.tokens == greedy_continuation(ToyBackend(), other, 3)
    drafter.end(0)
    d = drafter.draft([request(0, PROMPT[:-1], PROMPT[-1])])[0]
    assert d.tokens == greedy_continuation(ToyBackend(), PROMPT, 3)


# --- through the engine -------------------------------------------------------------------------------


def engine_run(draft_salt: int, sampling: SamplingParams, *, n_slots: int = 1, n_predict: int = 40,
               **spec: object) -> tuple[list[list[int]], dict, DraftSimpleDrafter]:
    drafter = DraftSimpleDrafter(ToyBackend(salt=draft_salt), target_n_vocab=V)
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=n_slots,
                         spec=SpecParams(types=("draft-simple",), adaptive=False).with_(**spec), drafters=[drafter])
    reqs = [CompletionRequest(prompt=PROMPT[: 6 + i], n_predict=n_predict, sampling=sampling) for i in range(n_slots)]
    import anyio

    finals = anyio.run(run_requests, engine, reqs)
    return [f.tokens for f in finals], engine.stats(), drafter


@pytest.mark.parametrize("n_slots", [1, 3])
def test_engine_greedy_draft_equals_target_accepts_everything(n_slots: int) -> None:
    outs, stats, _ = engine_run(0, GREEDY, n_slots=n_slots, n_max=4)
    for i, out in enumerate(outs):
        assert out == greedy_continuation(ToyBackend(), PROMPT[: 6 + i], 40)
    ds = stats["drafters"]["draft-simple"]
    assert ds["acc_tokens"] == ds["gen_tokens"] > 0  # identical model: every draft token accepted


@pytest.mark.parametrize("salt", [0, 5])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8, seed=42)])
def test_engine_greedy_drafting_is_lossless(sampling: SamplingParams, salt: int) -> None:
    """Same (salt 0) or unrelated (salt 5) draft model; sample-and-match keeps the seeded output exact."""
    outs, stats, _ = engine_run(salt, sampling, n_predict=30)
    ref = plain_decode(ToyBackend(), PROMPT[:6], n_predict=30, sampling=sampling, seed=42,
                       is_eog=lambda t: False, n_ctx=256)
    assert outs[0] == ref
    ds = stats["drafters"]["draft-simple"]
    assert ds["gen_tokens"] > 0 and (ds["acc_tokens"] > 0) == (salt == 0)


def test_engine_probabilistic_drafting_runs_rejection() -> None:
    sampling = SamplingParams(temperature=0.8, seed=3)
    outs1, stats, _ = engine_run(0, sampling, n_predict=30, draft_sampling="probabilistic")
    outs2, _, _ = engine_run(0, sampling, n_predict=30, draft_sampling="probabilistic")
    assert outs1 == outs2 and len(outs1[0]) == 30  # seeded: reproducible
    ds = stats["drafters"]["draft-simple"]
    assert 0 < ds["acc_tokens"] <= ds["gen_tokens"]


# --- real models through the torch backend ---------------------------------------------------------


def torch_engine_check(target_path: Path, draft_path: Path, prompt_text: str, n_predict: int,
                       sampling: SamplingParams, *, adaptive: bool = True) -> dict:
    """Engine output with draft-simple == plain decoding on the same backend type; returns drafter stats."""
    pytest.importorskip("spekula.backends.torch.backend")
    import anyio

    from spekula.core.backend import BackendOptions, load_backend
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer

    # One target backend serves the engine's 2 slots and the plain reference (loading SmolLM2 is slow).
    target = load_backend("torch", str(target_path), BackendOptions(n_ctx=256, n_seq_max=3))
    tok = Tokenizer.from_gguf(GGUFFile(target_path))
    spec = SpecParams(types=("draft-simple",), n_max=4, adaptive=adaptive)
    ctx = DrafterContext(spec=spec, target=target, tokenizer=tok, n_seq_max=2, draft_model_path=str(draft_path))
    engine = make_engine(target, tok, n_slots=2, spec=spec, drafters=[DraftSimpleDrafter.create(ctx)])
    prompt = tok.encode(prompt_text)
    req = CompletionRequest(prompt=prompt, n_predict=n_predict, sampling=sampling, ignore_eos=True)
    (final,) = anyio.run(run_requests, engine, [req], 300.0)
    ref = plain_decode(target, prompt, n_predict=n_predict,
                       sampling=sampling, seed=max(sampling.seed, 0), is_eog=tok.is_eog, n_ctx=256, ignore_eos=True)
    assert final.tokens == ref
    return engine.stats()["drafters"]["draft-simple"]


def test_tiny_gguf_draft_is_target_accepts_everything() -> None:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    p = tiny_model_path("llama")
    ds = torch_engine_check(p, p, "the quick brown fox", 30, GREEDY)
    assert ds["acc_tokens"] == ds["gen_tokens"] > 0


def test_tiny_gguf_truncated_draft_is_lossless(tmp_path: Path) -> None:
    from spekula.backends.convert.truncate import truncate_gguf
    from spekula.fixtures.tiny_gguf import tiny_model_path

    p = tiny_model_path("qwen3")
    draft = truncate_gguf(p, tmp_path / "draft.gguf", 2).path
    ds = torch_engine_check(p, draft, "the quick brown fox", 30, SamplingParams(temperature=0.7, seed=11))
    assert ds["gen_tokens"] > 0


@pytest.mark.slow
def test_smollm2_truncated_draft_greedy_is_lossless(tmp_path: Path) -> None:
    from spekula.backends.convert.truncate import truncate_gguf
    from spekula.backends.gguf.default_model import DefaultModelError, ensure_default_model

    try:
        target = ensure_default_model(quiet=True)
    except DefaultModelError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    draft = truncate_gguf(target, tmp_path / "smol-draft.gguf", 10).path
    # Fixed lengths: the cost model would (rightly) stop verifying this draft model's drafts.
    ds = torch_engine_check(target, draft, "The capital of France is Paris. The capital of Italy is", 24, GREEDY,
                            adaptive=False)
    assert 0 < ds["acc_tokens"] <= ds["gen_tokens"]
