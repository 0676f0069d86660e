"""draft-mtp through the engine on the tiny GLM-4.5-MoE targets: lossless output (1 and 2 heads, greedy,
sampled, probabilistic, hypothesis), the pairing/rebase rules, chained heads, a constructed head that
must be accepted, -md with an MTP-only GGUF, precedence, and the statistics line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from model_drafter_helpers import PROMPTS, Recording
from mtp_helpers import N_CTX, context, run_vs_plain, target_backend
from toy_backend import make_engine, plain_decode, run_requests

from spekula.core.backend import Backend, Capture, SeqInput
from spekula.core.drafting.drafter import Drafter, DraftRequest
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.drafters.model.mtp import MtpDrafter
from spekula.fixtures import tiny_mtp

SPEC = SpecParams(types=("draft-mtp",), n_max=3, adaptive=False)  # full-length drafts: they are what is checked


@pytest.fixture(scope="module", params=[1, 2], ids=["1-head", "2-heads"])
def random_target(request: pytest.FixtureRequest) -> Path:
    return tiny_mtp.random_mtp_gguf(request.param)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_random_heads_are_lossless(random_target: Path, backend: str) -> None:
    outs, refs, st = run_vs_plain(random_target, SPEC, backend=backend)
    assert outs == refs
    assert st["gen_drafts"] > 0 and st["gen_tokens"] >= st["gen_drafts"]


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_sampled_output_is_lossless(random_target: Path, backend: str) -> None:
    outs, refs, st = run_vs_plain(random_target, SPEC, sampling=SamplingParams(temperature=0.8, seed=7), backend=backend)
    assert outs == refs and st["gen_drafts"] > 0


def test_probabilistic_drafting_returns_q(random_target: Path) -> None:
    """Sampled drafts carry their top-10 distributions q (rejection sampling then keeps the target's
    distribution, not its tokens); at temperature 0 drafting stays greedy and the output plain."""
    spec = SPEC.with_(draft_sampling="probabilistic")
    outs, refs, st = run_vs_plain(random_target, spec, n_predict=12)
    assert outs == refs and st["gen_drafts"] > 0
    outs, _, st = run_vs_plain(random_target, spec, n_predict=12, sampling=SamplingParams(temperature=0.8, seed=11))
    assert [len(o) for o in outs] == [12, 12] and st["gen_drafts"] > 0
    target = target_backend(random_target)
    d = MtpDrafter.create(context(target, spec))
    prompt = [5, 17, 200, 33, 99, 120, 7, 8]
    observe(d, target, 0, target.new_seq(), prompt, 0)
    d.begin(0, np.array(prompt))
    (draft,) = d.draft([DraftRequest(0, np.array(prompt), 42, 8, spec, 0.8, 11)])
    assert draft.probs is not None and draft.probs.shape == (len(draft.tokens), target.info.n_vocab)
    np.testing.assert_allclose(draft.probs.sum(1), 1.0, atol=1e-5)
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
    assert (np.count_nonzero(draft.probs, axis=1) <= 10).all()  # top-10 candidates only


def observe(d: MtpDrafter, target: Backend, slot: int, seq: int, tokens: list[int], start: int) -> np.ndarray:
    inp = SeqInput(seq, np.array(tokens, dtype=np.int32), start)
    out = target.forward([inp], Capture(final_norm=True))[0]
    d.observe(slot, inp, out)
    return out.logits[-1]


def test_pairing_bridge_and_rebase() -> None:
    """A prompt in chunks writes what a one-shot prompt writes (the pending h bridges them); accept(n)
    rebases the pending h onto the accepted row and drops the heads' entries after it."""
    target = target_backend(tiny_mtp.random_mtp_gguf(1))
    d = MtpDrafter.create(context(target, SPEC))
    prompt = [5, 17, 200, 33, 99, 120, 7, 8]
    s0, s1 = target.new_seq(), target.new_seq()
    observe(d, target, 0, s0, prompt, 0)
    observe(d, target, 1, s1, prompt[:3], 0)
    observe(d, target, 1, s1, prompt[3:], 3)
    for slot in (0, 1):
        d.begin(slot, np.array(prompt))
    st0, st1 = d._slots.get(0), d._slots.get(1)
    assert st0.pending_pos == st1.pending_pos == len(prompt) - 1
    assert d.runtime.seq_len(st0.seq) == d.runtime.seq_len(st1.seq) == len(prompt)  # x_P paired with h_{P-1}, every P
    np.testing.assert_allclose(st0.pending_h, st1.pending_h, atol=1e-5)
    reqs = [DraftRequest(s, np.array(prompt), 42, 8, SPEC, 0.0, 0) for s in (0, 1)]
    a, b = d.draft(reqs)
    assert a.tokens == b.tokens and len(a.tokens) == SPEC.n_max
    assert d.runtime.seq_len(st0.seq) == len(prompt)  # drafted entries dropped again
    # Verification batch [x, d1, d2, d3] at len(prompt); accept 2 -> pending row = index 2.
    observe(d, target, 0, s0, [42, *a.tokens], len(prompt))
    rows = st0.verify_h
    assert rows is not None and d.runtime.seq_len(st0.seq) == len(prompt) + 4
    d.accept(0, 2, True)
    assert st0.pending_pos == len(prompt) + 2
    np.testing.assert_array_equal(st0.pending_h, rows[2])
    assert d.runtime.seq_len(st0.seq) == len(prompt) + 3


def _draft(d: MtpDrafter, prompt: list[int], budget: int = 8, **kw: Any) -> list[int]:
    return d.draft([DraftRequest(0, np.array(prompt), 42, budget, SPEC.with_(**kw), 0.0, 0)])[0].tokens


@pytest.mark.parametrize("n_heads", [1, 2])
def test_caps_p_min_n_min_and_chained_heads(n_heads: int) -> None:
    """n_max, the round budget, p_min and n_min as for the other model drafters; with 2 heads a draft
    is at most 2 tokens long (one step per head)."""
    target = target_backend(tiny_mtp.random_mtp_gguf(n_heads))
    d = MtpDrafter.create(context(target, SPEC))
    assert d.runtime.info.n_heads == n_heads and d.runtime.info.first_block == 3  # after the 3-block trunk
    prompt = [5, 17, 200, 33, 99, 120, 7, 8]
    observe(d, target, 0, target.new_seq(), prompt, 0)
    d.begin(0, np.array(prompt))
    full = _draft(d, prompt, n_max=6)
    assert len(full) == (6 if n_heads == 1 else 2)
    assert _draft(d, prompt, budget=1, n_max=6) == full[:1]
    assert _draft(d, prompt, n_max=1) == full[:1]
    assert _draft(d, prompt, n_max=6, n_min=len(full) + 1) == []
    assert _draft(d, prompt, n_max=6, p_min=1.01) == []  # top-10 probability never exceeds 1
    assert d.runtime.seq_len(d._slots.get(0).seq) == len(prompt)  # every draft undid its entries


def _step0_logits(d: MtpDrafter, r: DraftRequest) -> np.ndarray | None:
    """Head 0's logits for this request's first draft step, from the drafter's current caches (then undone)."""
    from spekula.core.drafting.mtp_runtime import MtpRows

    st, pos0 = d._slots.get(r.slot), len(r.history)
    if st is None or st.pending_h is None or st.pending_pos != pos0 - 1:
        return None
    d.runtime.truncate(st.seq, pos0)
    out = d.runtime.decode([MtpRows(st.seq, 0, np.array([r.last], np.int32), st.pending_h[None], pos0)])[0]
    d.runtime.truncate(st.seq, pos0)
    return out.logits


def test_drafts_made_in_the_engine_equal_a_from_scratch_reference(random_target: Path) -> None:
    """Every draft of a 2-slot engine run (prompt chunks, verification rounds, partial acceptance)
    equals the HF-formulation MTP recomputed from scratch over the committed history: the first step's
    logits within 1e-4 and the chained tokens (up to near-ties); so pairing, bridge, rebase and the
    chained heads' re-decoding keep the heads' caches what a fresh run would build."""
    import hf_moe_reference as R
    import torch
    from model_drafter_helpers import agree_unless_near_tie, assert_logits_close
    from mtp_reference import mtp_forward

    from spekula.fixtures.tiny_moe import tiny_moe_hf_path

    n_heads = GGUFFile(random_target).get("glm4moe.nextn_predict_layers")
    hf = tiny_moe_hf_path("glm4moe", n_mtp=n_heads)
    box: list[Recording] = []

    def wrap(d: Drafter) -> Drafter:
        box.append(Recording(d, _step0_logits))
        return box[0]  # type: ignore[return-value]

    outs, refs, _ = run_vs_plain(random_target, SPEC, n_predict=16, wrap=wrap)
    assert outs == refs
    log = [entry for entry in box[0].log if entry[2]]
    checked = 0
    for history, last, tokens, step0 in log:
        final = R.moe_target_forward(hf, history).final_hidden
        toks = [*history, last]
        hidden = [torch.zeros_like(final[0]), *final]  # entry P pairs x_P with h_{P-1}
        rows = []
        for i, tok in enumerate(tokens):
            logits, hout = mtp_forward(hf, i if n_heads > 1 else 0, toks, torch.stack(hidden))
            rows.append(logits[-1].numpy())
            toks, hidden = [*toks, tok], [*hidden, hout[-1]]
        assert_logits_close(step0, rows[0])
        checked += agree_unless_near_tie(tokens, rows)
    assert len(log) > 5 and checked > len(log)


@pytest.mark.parametrize("n_heads", [1, 2])
def test_constructed_head_is_accepted(n_heads: int) -> None:
    """tiny_mtp.agreeing_mtp_gguf: each head computes the target's own next-token function, so every
    greedy draft token is accepted up to near-ties of the target's logits (measured: all of them, with
    1 and 2 heads, at n_max 3 and 5)."""
    target = tiny_mtp.agreeing_mtp_gguf(n_mtp=n_heads)
    tok = Tokenizer.from_gguf(GGUFFile(target))
    prompts = [tok.encode(p) for p in (*PROMPTS, "hello world, hello world, and again", "a b c d e f g")]
    for n_max in (3, 5):
        outs, refs, st = run_vs_plain(target, SPEC.with_(n_max=n_max), n_predict=32, prompts=prompts, n_slots=2)
        assert outs == refs
        assert st["gen_tokens"] > 40
        assert st["acc_tokens"] >= 0.95 * st["gen_tokens"], st
        assert max(len(d) for d in [st["acc_per_pos"]]) == min(n_max, n_heads if n_heads > 1 else n_max)


def test_mtp_only_file_with_md_drafts_what_the_target_file_does() -> None:
    """-md with llama.cpp's --mtp layout (MTP blocks + token_embd, output_norm, output) holds the same
    heads: the same drafts, so the same statistics, as the heads read from the target itself."""
    target = tiny_mtp.random_mtp_gguf(1)
    draft = tiny_mtp.mtp_only_gguf(1)
    assert not GGUFFile(draft).has_tensor("blk.0.attn_norm.weight")
    own = run_vs_plain(target, SPEC, n_predict=16)
    md = run_vs_plain(target, SPEC, draft=draft, n_predict=16)
    assert own[0] == own[1] == md[0]
    keys = ("gen_drafts", "gen_tokens", "acc_tokens", "acc_per_pos")
    assert {k: own[2][k] for k in keys} == {k: md[2][k] for k in keys}
    # the same file as a target without its MTP layers: -md brings them
    trunk = tiny_mtp.trunk_only_gguf()
    outs, refs, st = run_vs_plain(trunk, SPEC, draft=draft, n_predict=16)
    assert outs == refs and st["gen_drafts"] > 0


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_bad_heads_are_one_clear_error(backend: str) -> None:
    from spekula.core.errors import SpekulaError
    from spekula.fixtures.tiny_gguf import tiny_model_path

    cases = [
        (tiny_model_path("llama"), None, "no multi-token-prediction layers"),
        (tiny_mtp.trunk_only_gguf(), None, "glm4moe.nextn_predict_layers is absent or 0"),
        (tiny_mtp.random_mtp_gguf(1), tiny_mtp.mismatched_mtp_gguf("vocab"), "vocabulary of 256 tokens"),
        (tiny_mtp.random_mtp_gguf(1), tiny_mtp.mismatched_mtp_gguf("hidden"), "hidden size 48"),
        (tiny_mtp.random_mtp_gguf(1), tiny_model_path("qwen3"), "no multi-token-prediction layers"),
    ]
    for target_path, draft, needle in cases:
        target = target_backend(target_path, 1, backend)
        with pytest.raises(SpekulaError, match=needle) as info:
            MtpDrafter.create(context(target, SPEC, draft, 1, backend))
        assert str(draft or target_path) in str(info.value)


_NO_CAPTURE = Capture()


class _NoFinalHidden(Backend):
    """A target that ignores Capture(final_norm=True)."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.info, self.options = inner, inner.info, inner.options

    def new_seq(self) -> int:
        return self.inner.new_seq()

    def free_seq(self, seq_id: int) -> None:
        self.inner.free_seq(seq_id)

    def seq_len(self, seq_id: int) -> int:
        return self.inner.seq_len(seq_id)

    def truncate(self, seq_id: int, n_keep: int) -> None:
        self.inner.truncate(seq_id, n_keep)

    def forward(self, inputs: Any, capture: Capture = _NO_CAPTURE) -> Any:
        outs = self.inner.forward(inputs, capture)
        for o in outs:
            o.hidden_final = None
        return outs


def test_a_backend_without_final_hidden_states_is_named() -> None:
    target = _NoFinalHidden(target_backend(tiny_mtp.random_mtp_gguf(1), 1))
    tok = Tokenizer.from_gguf(GGUFFile(target.info.path))
    engine = make_engine(target, tok, n_ctx=N_CTX, spec=SPEC, backend_name="nohidden")
    req = CompletionRequest(prompt=tok.encode("hello"), n_predict=4, sampling=SamplingParams(temperature=0.0))
    (final,) = anyio.run(run_requests, engine, [req], 120.0)
    assert final.error is not None and "nohidden backend" in final.error and "output_norm" in final.error


def test_ngram_drafts_come_first() -> None:
    """With an n-gram type alongside, the draftless drafter is asked first whatever the order given, and
    draft-mtp only drafts where it found nothing; the output stays plain decoding."""
    target_path = tiny_mtp.random_mtp_gguf(1)
    tok = Tokenizer.from_gguf(GGUFFile(target_path))
    repeated = tok.encode("the quick brown fox jumps over the lazy dog. " * 4)
    spec = SPEC.with_(types=("draft-mtp", "ngram-simple"), drafter_options={"spec-ngram-simple-size-n": 3,
                                                                            "spec-ngram-simple-size-m": 4})
    engine = make_engine(target_backend(target_path, 1), tok, n_slots=1, n_ctx=N_CTX, spec=spec)
    assert [d.name for d in engine._drafters_for(spec)] == ["ngram-simple", "draft-mtp"]
    sampling = SamplingParams(temperature=0.0)
    reqs = [CompletionRequest(prompt=p, n_predict=24, sampling=sampling, ignore_eos=True)
            for p in (repeated, tok.encode(PROMPTS[1]))]
    finals = anyio.run(run_requests, engine, reqs, 300.0)
    plain = target_backend(target_path, 1)
    for req, final in zip(reqs, finals, strict=True):
        assert final.error is None
        assert final.tokens == plain_decode(plain, req.prompt, n_predict=24, sampling=sampling, seed=0,
                                            is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True)
    stats = engine.stats()["drafters"]
    assert stats["ngram-simple"]["gen_drafts"] > 0 and stats["draft-mtp"]["gen_drafts"] > 0
    # one slot: draft-mtp is consulted exactly in the rounds where ngram-simple came back empty
    assert stats["draft-mtp"]["calls_draft"] == stats["ngram-simple"]["calls_draft"] - stats["ngram-simple"]["gen_drafts"]


@pytest.mark.parametrize("name", ["native", "onnx"])
def test_other_target_backends_feed_the_heads(name: str) -> None:
    """Through the engine on a native target (the heads on the native runtime) and an onnx one (the heads on
    torch): any backend returning Capture(final_norm=True) rows feeds them."""
    from spekula.core.errors import SpekulaError

    target_path = tiny_mtp.random_mtp_gguf(2)
    try:
        target = target_backend(target_path, 2, name)
    except (SpekulaError, ImportError) as exc:
        pytest.skip(f"{name} backend cannot load glm4moe here: {exc}")
    tok = Tokenizer.from_gguf(GGUFFile(target_path))
    engine = make_engine(target, tok, n_slots=2, n_ctx=N_CTX, spec=SPEC, backend_name=name)
    sampling = SamplingParams(temperature=0.0)
    prompts = [tok.encode(p) for p in PROMPTS]
    reqs = [CompletionRequest(prompt=p, n_predict=16, sampling=sampling, ignore_eos=True) for p in prompts]
    finals = anyio.run(run_requests, engine, reqs, 300.0)
    plain = target_backend(target_path, 1, name)
    for p, final in zip(prompts, finals, strict=True):
        assert final.error is None, final.error
        assert final.tokens == plain_decode(plain, p, n_predict=16, sampling=sampling, seed=0, is_eog=tok.is_eog,
                                            n_ctx=N_CTX, ignore_eos=True)
    assert engine.stats()["drafters"]["draft-mtp"]["gen_drafts"] > 0


# No shrinking: each example loads two targets; a failure report with the raw example is enough.
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(n_heads=st.sampled_from([1, 2]),
       prompts=st.lists(st.lists(st.integers(3, 300), min_size=1, max_size=8), min_size=1, max_size=2),
       repeats=st.integers(1, 3), n_max=st.integers(1, 5), n_predict=st.integers(1, 16),
       temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 2**31), adaptive=st.booleans(),
       constructed=st.booleans())
def test_lossless_hypothesis(n_heads: int, prompts: list[list[int]], repeats: int, n_max: int, n_predict: int,
                             temperature: float, seed: int, adaptive: bool, constructed: bool) -> None:
    target = tiny_mtp.agreeing_mtp_gguf(n_mtp=n_heads) if constructed else tiny_mtp.random_mtp_gguf(n_heads)
    spec = SPEC.with_(n_max=n_max, adaptive=adaptive)
    outs, refs, st = run_vs_plain(target, spec, n_predict=n_predict, prompts=[p * repeats for p in prompts],
                                  sampling=SamplingParams(temperature=temperature, seed=seed))
    assert outs == refs
    assert 0 <= st["acc_tokens"] <= st["gen_tokens"]
    assert not st["acc_per_pos"] or len(st["acc_per_pos"]) <= (min(n_max, n_heads) if n_heads > 1 else n_max)


def test_statistics_line_format() -> None:
    """llama.cpp's statistics line for draft-mtp comes from the shared counters."""
    from spekula.core.stats.stats import DrafterStats

    _, _, st = run_vs_plain(tiny_mtp.agreeing_mtp_gguf(n_mtp=1), SPEC, n_predict=16)
    stats = DrafterStats(n_call_begin=st["calls_begin"], n_call_draft=st["calls_draft"],
                         n_call_accept=st["calls_accept"], n_gen_drafts=st["gen_drafts"],
                         n_acc_drafts=st["acc_drafts"], n_gen_tokens=st["gen_tokens"], n_acc_tokens=st["acc_tokens"],
                         acc_per_pos=st["acc_per_pos"])
    line = stats.format_line("draft-mtp", prefix=True)
    assert re.match(r"spec common_specu: statistics        draft-mtp: #calls\(b,g,a\) =    2 +\d+ +\d+, "
                    r"#gen drafts = +\d+, #acc drafts = +\d+, #gen tokens = +\d+, #acc tokens = +\d+, "
                    r"#mean acc len = \d\.\d\d, #acc rate/pos = \(1\.000, 1\.000, [01]\.\d{3}\), dur", line), line
    assert DrafterStats.parse_line(line)[0] == "draft-mtp"
