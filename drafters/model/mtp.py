"""draft-mtp: a target's own multi-token-prediction heads draft from its final hidden states.

Pairing rule (llama.cpp's): the MTP KV entry at position P is computed from (token x_P, h_{P-1}),
where h is the target's hidden state after output_norm. After each target forward every row k is
written at its position paired with the previous row's h (row 0 with the h kept pending from the
previous forward; zeros before position 0); the forward's rows are kept for verification and the
last row's h stays pending, since the token after it is not known yet. Drafting decodes
(x, pending h) at x's position, then each drafted token with the previous step's output hidden
(hout). On verification, ``accept`` rebases the pending h onto the row of the last accepted token,
whoever drafted.

Several heads (nextn_predict_layers > 1) are chained: step i runs head i, the draft is at most as
long as there are heads, and every target forward is written into every head's KV cache. (llama.cpp
chains GLM's heads but runs a single Qwen3.5 MTP layer; here Qwen3.5's are chained too, each layer
around the input projection they share.) Each head
has its own cache, so step i decodes the whole draft prefix [x, d_1 .. d_i] under head i with the
hidden states [pending h, hout_0 .. hout_{i-1}] (its cache holds nothing past x's position).
Sampling follows the other model drafters: best (or sampled) of the top 10, p_min, n_min, n_max.

While the adaptive policy rests the heads (core/policy/backoff.py) the engine captures nothing for
them and they observe nothing (``resumes``). The first forward observed after such a gap has no h
for its first row (its predecessor was missed), so its entries start at its second row, and the
heads' caches go on after the gap as if the missed positions were not there (``HiddenSlot.offset``:
target position minus cache position), as EAGLE-3's draft KV does. The next forward pairs normally,
so a probe a couple of forwards later drafts from the target's current hidden state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from spekula.core.backend import Capture, SeqInput, SeqOutput
from spekula.core.drafting.assistant_runtime import check_assistant_files, is_assistant_file
from spekula.core.drafting.description import DrafterDescription
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftRequest
from spekula.core.drafting.mtp_runtime import MtpRows, MtpRuntime, check_mtp_files
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.drafters.model.hidden_drafter import (
    DraftRun,
    PendingHiddenSlot,
    SlotDrafter,
    final_hidden_rows,
    finish_drafts,
    head_runtime_backend,
    model_draft_options,
    shift_slot_cache,
    shifted_position,
)
from spekula.drafters.model.mtp_assistant import AssistantMtpDrafter
from spekula.drafters.model.runtimes import load_mtp_runtime

_Slot = PendingHiddenSlot  # the MTP heads keep nothing more per slot


@dataclass(slots=True)
class _Run(DraftRun):
    """A draft from x at position `start` (step j of a single head decodes at start + j)."""

    chain_h: list[np.ndarray] = field(default_factory=list)  # [pending h, hout_0, ...]


def is_mtp_file(f: GGUFFile) -> bool:
    """llama.cpp's test of a draft GGUF for MTP heads: its last block has a ``nextn.eh_proj`` tensor; or its
    first MTP block has, where later ones share it (Qwen3.5 with several MTP layers)."""
    arch = f.get("general.architecture")
    blocks, n_mtp = f.get(f"{arch}.block_count"), f.get(f"{arch}.nextn_predict_layers")
    if arch == "dflash" or not isinstance(blocks, int):
        return False
    first = blocks - n_mtp if isinstance(n_mtp, int) and 0 < n_mtp <= blocks else blocks - 1
    return any(f.has_tensor(f"blk.{b}.nextn.eh_proj.weight") for b in {blocks - 1, first})


def check_heads(target_path: str, draft_path: str | None) -> None:
    """The heads (or a KV-sharing assistant given with -md) exist and fit the target: from the files' headers alone."""
    if draft_path and is_assistant_file(GGUFFile.shared(draft_path)):
        check_assistant_files(target_path, draft_path)
    else:
        check_mtp_files(target_path, draft_path)


class MtpDrafter(SlotDrafter[MtpRuntime, _Slot]):
    name: ClassVar[str] = "draft-mtp"
    resumes: ClassVar[bool] = True  # may miss forwards (core/drafting/drafter.py)
    # `shifted` drops and re-ropes the heads' cache rows as the target's shift does.
    follows_context_shift: ClassVar[bool] = True
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="the target's own multi-token-prediction heads draft from its final hidden states "
                "(or an MTP GGUF or a Gemma 4 assistant given with -md)",
        builtin_order=8, hidden_states=True, draft_model="optional", implied_by=is_mtp_file, check_files=check_heads,
    )

    def __init__(self, runtime: MtpRuntime, backend_name: str) -> None:
        super().__init__(runtime)
        self.backend_name = backend_name
        self.n_heads = runtime.info.n_heads
        self._zero_h = np.zeros(runtime.info.n_embd, dtype=np.float32)

    def new_slot(self, seq: int) -> _Slot:
        return _Slot(seq)

    @classmethod
    def create(cls, ctx: DrafterContext) -> MtpDrafter | AssistantMtpDrafter:
        if ctx.draft_model_path and is_assistant_file(GGUFFile.shared(str(ctx.draft_model_path))):
            return AssistantMtpDrafter.create(ctx)
        options = model_draft_options(ctx)
        backend = head_runtime_backend(ctx.backend_name, options)
        runtime = load_mtp_runtime(backend, ctx.target, ctx.draft_model_path, options)
        return cls(runtime, ctx.backend_name)

    @property
    def chained(self) -> bool:
        return self.n_heads > 1

    # --- protocol (begin, end: SlotDrafter) ------------------------------------------------------
    def capture(self) -> Capture:
        return Capture(final_norm=True)

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        n = len(inp.tokens)
        if n == 0:
            return
        h = final_hidden_rows(out, self.name, self.backend_name, "the MTP heads read")
        st = self._slots.get(slot)
        if inp.start == 0:  # a new sequence in this slot
            self._cut(st, 0)
            st.pending_h, st.pending_pos = self._zero_h, -1
        tokens = np.asarray(inp.tokens, dtype=np.int32)
        if st.pending_h is not None and st.pending_pos == inp.start - 1:
            self._write(st, tokens, np.concatenate([st.pending_h[None], h[:-1]]), inp.start)  # row k pairs with h_{k-1}
        elif n > 1:  # after missed forwards: the first row's predecessor h is unknown
            self._write(st, tokens[1:], h[:-1], inp.start + 1)
        st.saw_rows(h, inp.start)

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        st = self._slots.peek(slot)
        if st is None or not st.accept_rows(n_accepted):
            return
        # Entries after the last accepted position pair rejected tokens: drop them.
        self._cut(st, st.pending_pos + 1)

    def shifted(self, slot: int, n_keep: int, n_discard: int) -> None:
        """The slot's target cache dropped positions [n_keep, n_keep + n_discard) and moved the later ones
        down: every head's cache does the same, and the pending h moves with its position."""
        st = self._slots.peek(slot)
        if st is None or n_discard <= 0:
            return
        shift_slot_cache(self.runtime, st, n_keep, n_discard)
        if st.pending_h is not None:
            pos = shifted_position(st.pending_pos, n_keep, n_discard)
            if pos is None:
                st.pending_h = None
            st.pending_pos = -1 if pos is None else pos
        st.verify_h = None  # the next forward brings the rows accept() reads

    # --- the heads' caches, in target positions ----------------------------------------------------
    def _length(self, st: _Slot) -> int:
        """The target position the heads' caches reach."""
        return self.runtime.seq_len(st.seq) + st.offset

    def _cut(self, st: _Slot, n_keep: int) -> None:
        """Keep target positions [0, n_keep) in every head's cache (a cut into a gap keeps nothing after it)."""
        if n_keep >= self._length(st):
            return
        keep = max(n_keep - st.offset, 0)
        self.runtime.truncate(st.seq, keep)
        st.offset = n_keep - keep

    def _write(self, st: _Slot, tokens: np.ndarray, hidden: np.ndarray, start: int) -> None:
        """Entries for target positions start.. in every head: a write there drops what came after it; a
        start past the caches' end follows forwards the heads missed, and they go on after the gap."""
        missed = start - self._length(st)
        if missed > 0:
            st.offset += missed
        self._cut(st, start)
        self.runtime.decode([MtpRows(st.seq, head, tokens, hidden, start - st.offset, want_last=False)
                             for head in range(self.n_heads)])

    # --- drafting --------------------------------------------------------------------------------
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        runs: list[_Run] = []
        for i, r in enumerate(requests):
            st = self._slots.peek(r.slot)
            pos0 = len(r.history)  # x's position; the pending h is the target's at pos0 - 1
            if st is None or st.pending_h is None or st.pending_pos != pos0 - 1 or self._length(st) < pos0:
                continue  # the heads' caches do not cover the committed history: no draft this round
            start = pos0 - st.offset  # x's position in the heads' caches
            cap = min(int(r.spec.n_max), int(r.n_max), self.runtime.n_ctx - start)
            if self.chained:
                cap = min(cap, self.n_heads)
            if cap <= 0:
                continue
            self.runtime.truncate(st.seq, start)
            prob = self.probabilistic(st, r)
            runs.append(_Run(i, st, int(r.last), start, cap, float(r.spec.p_min), float(r.temperature), prob,
                             keep_drafting=r.keep_drafting, chain_h=[st.pending_h]))
        active, step = runs, 0
        while active:
            if self.chained:  # head `step` rewrites its own cache over the draft region
                for run in active:
                    self.runtime.truncate(run.slot.seq, run.start)
            outs = self.runtime.decode([self._step_rows(run, step) for run in active])
            nxt: list[_Run] = []
            for run, out in zip(active, outs, strict=True):
                assert out.logits is not None and out.hidden is not None
                if run.take(out.logits) and not run.full:
                    run.chain_h.append(out.hidden)
                    nxt.append(run)
            active, step = nxt, step + 1
        return finish_drafts(self.runtime, requests, runs)

    def _step_rows(self, run: _Run, step: int) -> MtpRows:
        if self.chained:  # head `step` over the whole prefix [x, d_1 .. d_step]
            tokens = np.array([run.last, *run.tokens], dtype=np.int32)
            return MtpRows(run.slot.seq, step, tokens, np.stack(run.chain_h), run.start)
        token = run.last if step == 0 else run.tokens[-1]
        return MtpRows(run.slot.seq, 0, np.array([token], dtype=np.int32), run.chain_h[-1][None], run.start + step)
