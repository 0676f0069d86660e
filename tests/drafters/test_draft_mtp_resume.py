"""draft-mtp resumes after forwards it missed (Drafter.resumes): while the adaptive policy rests it the
engine captures nothing for it and it observes nothing; afterwards its heads' caches go on after the gap
as if the missed positions were not there, and it drafts from the target's current hidden state. On the
GLM-4.5 MTP files (1 and 2 heads) and the Qwen3.5 hybrids (a recurrent target), lossless throughout."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import numpy as np
import pytest
from mtp_helpers import N_CTX, context, target_backend
from toy_backend import make_engine, plain_decode, run_requests

from spekula.core.backend import Backend, Capture, SeqInput, SeqOutput
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftRequest
from spekula.core.drafting.mtp_runtime import MtpRows
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.policy.backoff import REST_FIRST
from spekula.drafters.model.mtp import MtpDrafter
from spekula.fixtures import tiny_mtp
from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

SPEC = SpecParams(types=("draft-mtp",), n_max=3, p_min=0.0, adaptive=False)
TARGETS = {
    "glm4moe-1-head": lambda: tiny_mtp.random_mtp_gguf(1),
    "glm4moe-2-heads": lambda: tiny_mtp.random_mtp_gguf(2),
    "qwen35-1-mtp": lambda: tiny_qwen35_gguf_path(n_mtp=1),
    "qwen35moe-2-mtp": lambda: tiny_qwen35_gguf_path(moe=True, n_mtp=2),
}


def _forward(target: Backend, seq: int, tokens: Sequence[int], start: int) -> tuple[SeqInput, SeqOutput]:
    inp = SeqInput(seq, np.array(tokens, dtype=np.int32), start)
    return inp, target.forward([inp], Capture(final_norm=True))[0]


def _step0(d: MtpDrafter, seq: int, last: int, h: np.ndarray, start: int) -> np.ndarray:
    """Head 0's logits for (last, h) at cache position `start` of runtime sequence `seq` (then undone)."""
    d.runtime.truncate(seq, start)
    out = d.runtime.decode([MtpRows(seq, 0, np.array([last], np.int32), h[None], start)])[0]
    d.runtime.truncate(seq, start)
    assert out.logits is not None
    return out.logits


@pytest.mark.parametrize("name", list(TARGETS))
def test_after_missed_forwards_the_caches_go_on_as_if_the_gap_were_not_there(name: str) -> None:
    """Prompt observed, 5 decode forwards missed, then a 3-row forward and a 1-row one observed: the heads hold
    the prompt's entries followed by the observed rows that have a known predecessor h (the 3-row forward's
    first row has none), at contiguous cache positions; the next draft reads exactly those entries."""
    target = target_backend(TARGETS[name](), name="native")
    d = MtpDrafter.create(context(target, SPEC, backend_name="native"))
    prompt = [5, 17, 200, 33, 99, 120, 7, 8]
    seq = target.new_seq()
    inp, out_prompt = _forward(target, seq, prompt, 0)
    d.observe(0, inp, out_prompt)
    d.begin(0, np.array(prompt))
    history = list(prompt)
    for t in (42, 43, 44, 45, 46):  # the rest: the target decodes, the drafter sees nothing
        _forward(target, seq, [t], len(history))
        history.append(t)
    inp3, out3 = _forward(target, seq, [11, 12, 13], len(history))
    d.observe(0, inp3, out3)
    inp1, out1 = _forward(target, seq, [14], len(history) + 3)
    d.observe(0, inp1, out1)
    history += [11, 12, 13, 14]
    st = d._slots.get(0)
    seen = len(prompt) + 2 + 1  # the prompt, rows 2 and 3 of the 3-row forward, the 1-row forward
    assert d.runtime.seq_len(st.seq) == seen and st.offset == len(history) - seen
    assert st.pending_pos == len(history) - 1
    assert st.pending_h is not None and out1.hidden_final is not None
    np.testing.assert_array_equal(st.pending_h, out1.hidden_final[-1])

    # The same entries written into a fresh sequence without any gap.
    assert out_prompt.hidden_final is not None and out3.hidden_final is not None
    ref = d.runtime.new_seq()
    zero = np.zeros((1, d.runtime.info.n_embd), np.float32)
    rows = [(prompt, np.concatenate([zero, out_prompt.hidden_final[:-1]]), 0),
            ([12, 13], out3.hidden_final[:2], len(prompt)),
            ([14], out3.hidden_final[2:], len(prompt) + 2)]
    for tokens, hidden, start in rows:
        d.runtime.decode([MtpRows(ref, head, np.array(tokens, np.int32), hidden, start, want_last=False)
                          for head in range(d.n_heads)])
    assert d.runtime.seq_len(ref) == seen
    x = 77
    np.testing.assert_allclose(_step0(d, st.seq, x, st.pending_h, seen), _step0(d, ref, x, st.pending_h, seen),
                               rtol=1e-5, atol=1e-5)
    (draft,) = d.draft([DraftRequest(0, np.array(history), x, 8, SPEC, 0.0, 0)])
    assert len(draft.tokens) == (SPEC.n_max if d.n_heads == 1 else d.n_heads)
    assert d.runtime.seq_len(st.seq) == seen  # the draft's entries undone
    # Verification of [x, *draft] observed, one draft token accepted: the caches keep up to the accepted row.
    d.observe(0, *_forward(target, seq, [x, *draft.tokens], len(history)))
    d.accept(0, 1, True)
    assert d.runtime.seq_len(st.seq) + st.offset == len(history) + 2 and st.pending_pos == len(history) + 1


class _SlowMtp(MtpDrafter):
    """draft-mtp whose calls are dear (a sleep), so the adaptive policy rests it; records what it observes."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.observed: list[tuple[int, int]] = []  # (start, rows)
        self.drafted: list[tuple[int, int]] = []  # (history length, draft length)

    @classmethod
    def create(cls, ctx: DrafterContext) -> _SlowMtp:
        d = super().create(ctx)
        assert isinstance(d, _SlowMtp)
        return d

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        assert out.hidden_final is not None  # whenever it observes, its capture was made
        self.observed.append((inp.start, len(inp.tokens)))
        super().observe(slot, inp, out)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        time.sleep(0.02)  # many tiny forwards' worth
        drafts = super().draft(requests)
        self.drafted += [(len(r.history), len(d.tokens)) for r, d in zip(requests, drafts, strict=True)]
        return drafts


class _CountingCaptures:
    """The target's forward, counting the forwards that captured the final hidden states."""

    def __init__(self, target: Backend) -> None:
        self.forwards, self.captured = 0, 0
        self._forward = target.forward
        target.forward = self  # type: ignore[method-assign]

    def __call__(self, inputs: Sequence[SeqInput], capture: Capture = Capture()) -> list[SeqOutput]:  # noqa: B008
        self.forwards += 1
        self.captured += int(capture.final_norm)
        return self._forward(inputs, capture)


@pytest.mark.parametrize("name", ["glm4moe-2-heads", "qwen35-1-mtp"])
def test_a_rested_draft_mtp_observes_nothing_and_drafts_again_after_the_rest(name: str) -> None:
    """Adaptive lengths on: a head whose calls lose rests; during the rest nothing is captured for it and it
    observes no forward; its probes after a rest still draft; output equals plain decoding."""
    path = TARGETS[name]()
    spec = SPEC.with_(adaptive=True)
    sampling = SamplingParams(temperature=0.0)
    target = target_backend(path, 1, "native")
    tok = Tokenizer.from_gguf(GGUFFile(path))
    d = _SlowMtp.create(context(target, spec, n_slots=1, backend_name="native"))
    counts = _CountingCaptures(target)
    engine = make_engine(target, tok, n_ctx=N_CTX, spec=spec, drafters=[d])
    prompt, n_predict = [5, 17, 200, 33, 99, 120, 7, 8], 150
    [final] = anyio.run(run_requests, engine, [CompletionRequest(prompt, n_predict=n_predict, sampling=sampling,
                                                                 ignore_eos=True)], 300.0)
    expected = plain_decode(target_backend(path, 1, "native"), prompt, n_predict=n_predict, sampling=sampling,
                            seed=0, is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True)
    assert final.tokens == expected
    assert len(d.observed) < 0.5 * counts.forwards and counts.captured == len(d.observed)
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(d.observed, d.observed[1:], strict=False)]
    assert max(gaps) >= REST_FIRST // 2  # it missed a rest's forwards
    # The calls after the first rest (the probes) all draft: the heads' caches cover the history again.
    resumed_at = d.observed[gaps.index(max(gaps)) + 1][0]
    after = [n for length, n in d.drafted if length > resumed_at]
    assert after and all(n > 0 for n in after)
