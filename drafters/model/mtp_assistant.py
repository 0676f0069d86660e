"""draft-mtp with a KV-sharing assistant (Gemma 4's ``gemma4-assistant`` given with -md), as llama.cpp's
MTP driver runs one whose memory is the target's.

The assistant keeps no cache, so nothing is written after a target forward: ``observe`` keeps the
forward's post-norm hidden states (for ``accept``) and the last one as the pending h, with the target
sequence whose cache the assistant reads. A draft for x at position P (the target's cache holds exactly
[0, P) then, the engine having cut it back to the committed history) runs the assistant on (x, pending
h) at P, then on each drafted token with the previous step's output hidden, every step at the same P.
``accept`` rebases the pending h onto the row of the last accepted token, whoever drafted. A forward
observed after missed ones still leaves a pending h for its last row, so a resting drafter needs no
catching up (``resumes``). Sampling follows the other model drafters (best or sampled of the top 10,
p_min, n_min, n_max).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from spekula.core.backend import Capture, SeqInput, SeqOutput
from spekula.core.drafting.assistant_runtime import AssistantRow, AssistantRuntime
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftRequest
from spekula.core.drafting.slot_states import SlotStates
from spekula.core.errors import ConfigError
from spekula.drafters.model.hidden_drafter import DraftRun, PendingHiddenSlot, SlotDrafter, final_hidden_rows
from spekula.drafters.model.runtimes import load_assistant_runtime


@dataclass(slots=True)
class _Slot(PendingHiddenSlot):
    target_seq: int = -1  # the target sequence of the slot's last observed forward


class AssistantMtpDrafter:
    """draft-mtp's mode for an assistant over the target's KV (made by MtpDrafter.create)."""

    name: ClassVar[str] = "draft-mtp"
    model_based: ClassVar[bool] = True
    resumes: ClassVar[bool] = True

    def __init__(self, runtime: AssistantRuntime, backend_name: str) -> None:
        self.runtime = runtime
        self.backend_name = backend_name
        self._slots: SlotStates[_Slot] = SlotStates(lambda slot: _Slot(slot))

    @classmethod
    def create(cls, ctx: DrafterContext) -> AssistantMtpDrafter:
        """The assistant of -md on the target's own backend, whose KV cache it reads."""
        if not ctx.draft_model_path:
            raise ConfigError(f"{cls.name}: a KV-sharing assistant is given with -md")
        return cls(load_assistant_runtime(ctx.backend_name, ctx.target, str(ctx.draft_model_path)), ctx.backend_name)

    def capture(self) -> Capture:
        return Capture(final_norm=True)

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        st = self._slots.get(slot)
        st.rng, st.rng_key = None, None

    def end(self, slot: int) -> None:
        self._slots.pop(slot)

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        n = len(inp.tokens)
        if n == 0:
            return
        h = final_hidden_rows(out, self.name, self.backend_name, "the assistant reads")
        st = self._slots.get(slot)
        st.target_seq = inp.seq_id
        st.saw_rows(h, inp.start)

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        st = self._slots.peek(slot)
        if st is not None:
            st.accept_rows(n_accepted)

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        runs: list[tuple[DraftRun, _Slot, np.ndarray]] = []
        for i, r in enumerate(requests):
            st = self._slots.peek(r.slot)
            pos0 = len(r.history)  # x's position; the pending h is the target's at pos0 - 1
            if st is None or st.pending_h is None or st.pending_pos != pos0 - 1 or pos0 <= 0:
                continue
            cap = min(int(r.spec.n_max), int(r.n_max))
            if cap <= 0:
                continue
            prob = SlotDrafter.probabilistic(st, r)
            run = DraftRun(i, st, int(r.last), pos0, cap, float(r.spec.p_min), float(r.temperature), prob)
            runs.append((run, st, st.pending_h))
        active = runs
        while active:
            outs = self.runtime.step([AssistantRow(st.target_seq, run.tokens[-1] if run.tokens else run.last, h,
                                                   run.start) for run, st, h in active])
            nxt = []
            for (run, st, _), out in zip(active, outs, strict=True):
                assert out.logits is not None and out.hidden is not None
                if run.take(out.logits) and not run.full:
                    nxt.append((run, st, out.hidden))
            active = nxt
        result = [Draft.empty() for _ in requests]
        for run, _, _ in runs:
            if run.tokens and len(run.tokens) >= int(requests[run.index].spec.n_min):
                probs = np.stack(run.probs) if run.probabilistic and run.probs else None
                result[run.index] = Draft(run.tokens, probs, run.confidence)
        return result
