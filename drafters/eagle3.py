"""draft-eagle3: one Llama layer drafts from the target's own hidden states (docs/model-formats.md §2.6).

Pairing rule: the draft KV entry at position P is computed from (token at P+1, g_P), where g_P is
the fc projection of the target's three captured layer inputs at P. So after each target forward the
last row is *pending* (its next token is not known yet): its g is kept, and the draft starts from
``(x, g_pending)`` at the pending position. Later steps feed the layer's own pre-norm output back as g.
On verification, ``accept`` rebases the pending row onto the last accepted row (whoever drafted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from spekula.core.backend import SeqInput, SeqOutput
from spekula.core.draft_models import Eagle3Rows, Eagle3Runtime, load_draft_runtime
from spekula.core.drafter import Draft, DrafterContext, DraftRequest
from spekula.core.errors import ConfigError

from .hidden_drafter import (
    DraftRun,
    HiddenSlot,
    HiddenStateDrafter,
    finish_drafts,
    model_draft_options,
    require_draft_path,
)


@dataclass(slots=True)
class _Slot(HiddenSlot):
    pending_g: np.ndarray | None = None  # [H] g of the last target row whose successor is unknown
    pending_pos: int = -1
    verify_g: np.ndarray | None = None  # [n, H] every row of the last target forward
    verify_pos: int = 0


class Eagle3Drafter(HiddenStateDrafter[Eagle3Runtime, _Slot]):
    name: ClassVar[str] = "draft-eagle3"

    @classmethod
    def create(cls, ctx: DrafterContext) -> Eagle3Drafter:
        path = require_draft_path(ctx, cls.name)
        # Draft runtimes exist for torch only; an onnx target still hands over numpy hidden states.
        runtime = load_draft_runtime("torch", path, ctx.target.info, model_draft_options(ctx))
        if not isinstance(runtime, Eagle3Runtime):
            raise ConfigError(f"{path} is a {runtime.info.kind} model, not EAGLE-3; use --spec-type draft-{runtime.info.kind}")
        return cls(runtime)

    # --- protocol (capture, begin, end: HiddenStateDrafter) ---------------------------------------
    def new_slot(self, seq: int) -> _Slot:
        return _Slot(seq)

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        n = len(inp.tokens)
        if n == 0:
            return
        st = self._slots.get(slot)
        if inp.start == 0:  # a new sequence in this slot
            self.runtime.truncate(st.seq, 0)
            st.pending_g = None
        g = self.runtime.encode(self.features(out))
        tokens = np.asarray(inp.tokens, dtype=np.int32)
        have = self.runtime.seq_len(st.seq)
        if st.pending_g is not None and st.pending_pos == inp.start - 1 and have <= st.pending_pos:
            # Bridge: the previous forward's last row pairs with this forward's first token.
            rows = Eagle3Rows(st.seq, tokens, np.concatenate([st.pending_g[None], g[:-1]]), st.pending_pos, False)
        else:
            rows = Eagle3Rows(st.seq, tokens[1:], g[:-1], inp.start, False)
        if len(rows.tokens) and self.runtime.seq_len(st.seq) >= rows.start:
            self.runtime.decode([rows])
        st.pending_g, st.pending_pos = g[-1], inp.start + n - 1
        st.verify_g, st.verify_pos = g, inp.start

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        st = self._slots.peek(slot)
        if st is None or st.verify_g is None:
            return
        i = min(int(n_accepted), len(st.verify_g) - 1)
        st.pending_g, st.pending_pos = st.verify_g[i], st.verify_pos + i
        # Entries from the pending position on pair rejected tokens: drop them.
        self.runtime.truncate(st.seq, st.pending_pos)

    # --- drafting --------------------------------------------------------------------------------
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        runs: list[DraftRun] = []
        first: list[Eagle3Rows] = []
        for i, r in enumerate(requests):
            # step j writes at len(history) - 1 + j: stay inside the draft context
            cap = min(int(r.spec.n_max), int(r.n_max), self.runtime.n_ctx - len(r.history) + 1)
            st = self._slots.peek(r.slot)
            if cap <= 0 or st is None or st.pending_g is None:
                continue
            pos = len(r.history) - 1  # the row whose successor is x; step j decodes at pos + j
            if st.pending_pos != pos or self.runtime.seq_len(st.seq) < pos:
                continue  # features for the committed history are incomplete: no draft this round
            self.runtime.truncate(st.seq, pos)
            prob = self.probabilistic(st, r)
            runs.append(DraftRun(i, st, int(r.last), pos, cap, float(r.spec.p_min), float(r.temperature), prob))
            first.append(Eagle3Rows(st.seq, np.array([r.last], dtype=np.int32), st.pending_g[None], pos))
        active, rows = runs, first
        while active:
            outs = self.runtime.decode(rows)
            nxt: list[DraftRun] = []
            rows = []
            for run, out in zip(active, outs, strict=True):
                assert out.logits is not None
                if run.take(out.logits[-1]) and not run.full:
                    nxt.append(run)
                    rows.append(Eagle3Rows(run.slot.seq, np.array([run.tokens[-1]], dtype=np.int32), out.prenorm[-1:],
                                           run.start + len(run.tokens)))
            active = nxt
        return finish_drafts(self.runtime, requests, runs)
