"""draft-dflash: block denoising over the target's hidden states (docs/model-formats.md §3.3).

Every target forward's captured features become keys/values of every draft layer at their positions
(prompt chunks and verification rows alike; a later write at a position replaces what was there and
after it). A draft is one non-causal forward of the block ``[x, MASK, ...]`` at positions
``pos0..``; block index j proposes the token at pos0+j. The block has the head's trained size whatever
the draft's length (``block_drafts``); only the rows the draft reads go through the output head. The
block's own K/V are dropped afterwards so only target context persists. ``--spec-draft-n-max`` is
clamped to block_size - 1.

The context is injected lazily: each forward's features are queued, cut where a later forward
rewrites them, and injected in one batch when the drafter is next asked for a draft (only the rows
up to the committed history, so rejected verification rows are never injected). A round in which
the cost model does not ask the drafter costs it nothing. While the adaptive policy rests the head
(core/policy/backoff.py) it observes nothing and nothing is captured for it (``resumes``); its
context then goes on after the gap as if the missed positions were not there (``HiddenSlot.offset``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from spekula.core.backend import SeqInput, SeqOutput
from spekula.core.drafting.description import DrafterDescription
from spekula.core.drafting.draft_models import DFlashBlock, DFlashOut, DFlashRuntime, choose, read_draft_info
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftRequest
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.drafters.model.hidden_drafter import (
    HiddenSlot,
    HiddenStateDrafter,
    drop_queued_tail,
    load_head_runtime,
    model_draft_options,
    require_draft_path,
    shift_slot_cache,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DFlashSlot(HiddenSlot):
    # Features not yet injected, contiguous from the runtime's length: row k of the concatenation is
    # position len + k.
    queue: list[np.ndarray] = field(default_factory=list)
    queued: int = 0


@dataclass(slots=True)
class _Plan:
    index: int
    slot: DFlashSlot
    pos0: int  # the block's first position in the draft cache
    block: np.ndarray
    n_spec: int  # tokens it drafts before the request's cap
    cap: int


def is_draft_kind(kind: str) -> Callable[[GGUFFile], bool]:
    """Whether a draft GGUF is a DFlash file of `kind` (dflash or dspark): such a file given alone
    implies its type, as in llama.cpp."""
    def test(f: GGUFFile) -> bool:
        return f.get("general.architecture") == "dflash" and read_draft_info(f).kind == kind
    return test


class DFlashDrafter(HiddenStateDrafter[DFlashRuntime, DFlashSlot]):
    name: ClassVar[str] = "draft-dflash"
    kind: ClassVar[str] = "dflash"
    resumes: ClassVar[bool] = True  # may miss forwards (core/drafting/drafter.py)
    # `shifted` drops and re-ropes the injected context as the target's shift does (DSpark inherits it).
    follows_context_shift: ClassVar[bool] = True
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="a DFlash head drafts a whole block in one forward from the target's layer inputs "
                "(-md, else a shipped head)",
        builtin_order=9, hidden_states=True, draft_model="optional", implied_by=is_draft_kind("dflash"),
    )

    def __init__(self, runtime: DFlashRuntime) -> None:
        super().__init__(runtime)
        self.info = runtime.info
        self._warned: set[str] = set()

    @classmethod
    def create(cls, ctx: DrafterContext) -> DFlashDrafter:
        path = require_draft_path(ctx, cls.name)
        runtime = load_head_runtime(ctx, path, model_draft_options(ctx, extra_ctx=64))
        if not isinstance(runtime, DFlashRuntime) or runtime.info.kind != cls.kind:
            raise ConfigError(f"{path} is a {runtime.info.kind} model, not {cls.kind}; "
                              f"use --spec-type draft-{runtime.info.kind}")
        if runtime.info.block_size + 1 > 64:
            raise ConfigError(f"{path}: block_size {runtime.info.block_size} is larger than this runtime supports (63)")
        drafter = cls(runtime)
        drafter.check_spec(ctx.spec.n_max, ctx.spec.p_min)
        return drafter

    def check_spec(self, n_max: int, p_min: float) -> None:
        limit = self.max_block_draft()
        if n_max > limit:
            self._warn(f"--spec-draft-n-max {n_max} clamped to {limit} (block_size {self.info.block_size})")

    def _warn(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning("%s: %s", self.name, msg)

    # --- protocol (capture, begin, end: HiddenStateDrafter) ---------------------------------------
    def new_slot(self, seq: int) -> DFlashSlot:
        return DFlashSlot(seq)

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        if len(inp.tokens) == 0:
            return
        st = self._slots.get(slot)
        missed = inp.start - self.context_length(st)
        if missed > 0:  # forwards missed while resting: the context goes on after them
            st.offset += missed
        self._cut(st, inp.start)
        st.queue.append(self.features(out))
        st.queued += len(inp.tokens)

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        # Rejected rows stay queued beyond the committed end; draft() cuts at the context first.
        return None

    def shifted(self, slot: int, n_keep: int, n_discard: int) -> None:
        """The slot's target cache dropped positions [n_keep, n_keep + n_discard) and moved the later
        ones down: the injected context does the same. Queued rows are injected first, so one shift moves
        them all (rows past the committed history move too; the next draft cuts them, as it does unshifted)."""
        st = self._slots.peek(slot)
        if st is None or n_discard <= 0:
            return
        if st.queued:
            self.runtime.inject(st.seq, np.concatenate(st.queue), self.runtime.seq_len(st.seq))
            st.queue, st.queued = [], 0
        shift_slot_cache(self.runtime, st, n_keep, n_discard)

    # --- the lazy context --------------------------------------------------------------------------
    def context_length(self, st: DFlashSlot) -> int:
        """The target position the slot's context reaches, injected or queued."""
        return self.runtime.seq_len(st.seq) + st.queued + st.offset

    def _cut(self, st: DFlashSlot, n_keep: int) -> None:
        """Keep target positions [0, n_keep) of the context, injected and queued together."""
        base = self.runtime.seq_len(st.seq) + st.offset
        if n_keep <= base:
            keep = max(n_keep - st.offset, 0)  # a cut into a gap keeps nothing after it
            self.runtime.truncate(st.seq, keep)
            st.offset = n_keep - keep
            st.queue, st.queued = [], 0
            return
        drop_queued_tail([st.queue], base + st.queued - n_keep)
        st.queued = min(st.queued, n_keep - base)  # a cut past the end keeps everything

    def sync(self, st: DFlashSlot, pos0: int) -> bool:
        """Bring the injected context to exactly target positions [0, pos0); False when the slot lacks
        some of it."""
        if self.context_length(st) < pos0:
            return False
        self._cut(st, pos0)
        if st.queued:
            self.runtime.inject(st.seq, np.concatenate(st.queue), self.runtime.seq_len(st.seq))
            st.queue, st.queued = [], 0
        return True

    # --- block layout (DSpark overrides) ------------------------------------------------------------
    def max_block_draft(self) -> int:
        return self.info.block_size - 1

    def block_at(self, last: int, n_spec: int, pos0: int) -> np.ndarray:
        """The block that drafts up to n_spec tokens after `last` at target position pos0."""
        return self.block_for(last, self.block_drafts(n_spec, self.runtime.n_ctx - pos0 - 1))

    def block_drafts(self, n_spec: int, room: int) -> int:
        """How many draft rows the block holds for a draft of up to n_spec tokens, `room` rows fitting
        after x: the head's trained block whatever the draft's length, where it fits. The head learned
        to denoise whole blocks, and its first rows draft better in one: SmolLM2's shipped head, its
        first three tokens over 10 held-out chats and 2 code prompts (96 generated tokens each), accepted
        prefixes 251 -> 263 (chat) and 121 -> 126 (code) from a 7-row block to its trained 8, and 234
        and 101 in a 4-row block (n_max 3, the default). The rows past the draft cost only their part
        of the block's layers (no output head: logit_rows), about 0.05 ms a row on SmolLM2."""
        return max(n_spec, min(self.max_block_draft(), room))

    def block_for(self, last: int, n: int) -> np.ndarray:
        """[x, MASK * n] for n drafts: index j (1..n) proposes the token at pos0 + j."""
        return np.array([last] + [self.info.mask_token_id] * n, dtype=np.int32)

    def read_rows(self, n: int) -> range:
        """Block indices holding the n drafts, in order."""
        return range(1, n + 1)

    def logit_rows(self, plan: _Plan) -> range:
        """The block indices a plan's draft is read from, in order: its cap's worth of read_rows (the
        runtime computes logits for these only; DFlashOut's row i is index i of this range)."""
        return self.read_rows(plan.n_spec)[: plan.cap]

    def select(self, plan: _Plan, out: DFlashOut, req: DraftRequest) -> Draft:
        rng = plan.slot.rng if req.spec.draft_sampling == "probabilistic" and req.temperature > 0 else None
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        confidence: list[float] = []
        for i in range(len(self.logit_rows(plan))):
            c = choose(out.logits[i], req.temperature, rng, vocab=out.vocab, n_vocab=self.info.n_vocab)
            if c.p_top < float(req.spec.p_min):
                break
            tokens.append(c.token)
            confidence.append(c.p_top)
            if c.q is not None:
                probs.append(c.q)
        return Draft(tokens, np.stack(probs) if rng is not None and probs else None, confidence)

    # --- drafting --------------------------------------------------------------------------------
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        plans: list[_Plan] = []
        for i, r in enumerate(requests):
            st = self._slots.peek(r.slot)
            n_spec = min(int(r.spec.n_max), self.max_block_draft())
            pos0 = len(r.history)
            if st is None or n_spec <= 0 or int(r.n_max) <= 0 or self.context_length(st) < pos0:
                continue
            block = self.block_at(int(r.last), n_spec, pos0)
            if pos0 + len(block) > self.runtime.n_ctx or not self.sync(st, pos0):
                continue
            self.probabilistic(st, r)
            plans.append(_Plan(i, st, pos0 - st.offset, block, n_spec, min(n_spec, int(r.n_max))))
        outs = self.runtime.draft_blocks([DFlashBlock(p.slot.seq, p.block, p.pos0, self.logit_rows(p)) for p in plans])
        result = [Draft.empty() for _ in requests]
        for plan, out in zip(plans, outs, strict=True):
            self.runtime.truncate(plan.slot.seq, plan.pos0)  # only target context persists
            req = requests[plan.index]
            d = self.select(plan, out, req)
            n_min = min(int(req.spec.n_min), self.max_block_draft())
            if d.tokens and len(d.tokens) >= n_min:
                result[plan.index] = d
        return result
