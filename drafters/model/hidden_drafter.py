"""What the hidden-state drafters (draft-eagle3, draft-dflash, draft-dspark, draft-mtp) share.

All keep one draft-runtime sequence per slot and a per-request probabilistic sampler
(:class:`SlotDrafter`); all but draft-mtp read the target's captured layer inputs
(:class:`HiddenStateDrafter`; draft-mtp reads its final hidden states). Draft-eagle3 and draft-mtp
grow their drafts a token a step the same way (:class:`DraftRun`, :func:`finish_drafts`). This
module holds that once, and the option and path rules for loading a draft model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, Generic, Protocol, TypeVar

import numpy as np

from spekula.core.backend import BackendOptions, Capture, SeqOutput
from spekula.core.drafting.draft_models import (
    DFlashRuntime,
    DraftRuntime,
    Eagle3Runtime,
    choose,
    draft_rng,
)
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftRequest
from spekula.core.drafting.slot_states import SlotStates
from spekula.core.errors import ConfigError
from spekula.drafters.model.runtimes import load_draft_runtime
from spekula.drafters.model.shipped_heads import shipped_draft_path

# Draft runtimes compute in a float type; a target's other dtypes (onnx's q4 graphs) mean "the device's".
DRAFT_DTYPES = ("auto", "f32", "f16", "bf16")


def model_draft_options(ctx: DrafterContext, extra_ctx: int = 0) -> BackendOptions:
    """Draft runtime options: the target's device/dtype unless --spec-draft-* said otherwise (a dtype no
    draft runtime computes in becomes "auto"), one sequence per slot, and the target's context (plus
    room for a draft block beyond it)."""
    base = ctx.draft_backend_options or ctx.target.options
    dtype = base.dtype if base.dtype in DRAFT_DTYPES else "auto"
    return replace(base, dtype=dtype, n_ctx=ctx.target.n_ctx + extra_ctx, n_seq_max=max(ctx.n_seq_max, 1))


def head_runtime_backend(backend_name: str, options: BackendOptions) -> str:
    """Which runtime runs a model drafter's heads: the native kernels when the native backend runs the
    target (over the target's threads and its prepared embedding and head, in the GGUF's block types),
    unless --spec-draft-device / --spec-draft-dtype ask for another device or a float type; torch
    otherwise (torch and onnx targets: onnx graphs run trunks only). A head architecture without a
    native runtime runs on torch's CPU path beside a native target."""
    if backend_name == "native" and options.device.strip().lower() == "cpu" and options.dtype in ("auto", "native"):
        return "native"
    return "torch"


def load_head_runtime(ctx: DrafterContext, path: str, options: BackendOptions) -> Eagle3Runtime | DFlashRuntime:
    """The head's runtime (see head_runtime_backend). A torch runtime beside the native kernels runs on
    one thread: measured on SmolLM2 (2 cores), torch's idle worker threads spin-wait after each small
    draft step and the target's own forward took 6.8-7.3 ms instead of 4.2-4.4 (EAGLE-3 108 -> 131
    tok/s, DFlash 99 -> 139 tok/s)."""
    backend = head_runtime_backend(ctx.backend_name, options)
    runtime = load_draft_runtime(backend, path, ctx.target.info, options, target_backend=ctx.target)
    if ctx.backend_name == "native":
        runtime.share_cpu()
    return runtime


def require_draft_path(ctx: DrafterContext, name: str) -> str:
    """-md's file, else the head shipped for the target (drafters/model/shipped_heads.py), else a ConfigError."""
    if not ctx.draft_model_path:
        return shipped_draft_path(name, ctx.target.info.path)
    return str(ctx.draft_model_path)


def drop_queued_tail(queues: Sequence[list[np.ndarray]], drop: int) -> None:
    """Remove the newest `drop` rows from parallel queues of row arrays (entry k of each queue has the
    same length): the lazy context of EAGLE-3 and DFlash, cut where a later forward rewrites it."""
    lead = queues[0]
    while drop > 0:
        last = len(lead[-1])
        if last <= drop:
            for q in queues:
                q.pop()
            drop -= last
        else:
            for q in queues:
                q[-1] = q[-1][:-drop]
            drop = 0


@dataclass(slots=True)
class HiddenSlot:
    seq: int  # the slot's sequence in the draft runtime
    rng: np.random.Generator | None = None
    rng_key: tuple[float, int] | None = None  # (temperature, seed) rng was seeded for
    # Target positions minus draft-cache positions: the forwards the drafter missed while its policy
    # rested it (Drafter.resumes). Its cache goes on after such a gap as if the gap were not there.
    offset: int = 0


@dataclass(slots=True)
class PendingHiddenSlot(HiddenSlot):
    """A slot of a drafter whose drafts start from the target's hidden row (draft-mtp's two modes): the
    row whose successor is not known yet, and every row of the last target forward, one of which
    becomes pending when the verify's accepted count is known."""

    pending_h: np.ndarray | None = None  # [H] h of the last target row whose successor is unknown
    pending_pos: int = -1  # its position
    verify_h: np.ndarray | None = None  # [n, H] every row of the last target forward
    verify_pos: int = 0

    def saw_rows(self, h: np.ndarray, start: int) -> None:
        """A target forward from position `start` gave the rows `h`: its last row is pending."""
        self.pending_h, self.pending_pos = h[-1], start + len(h) - 1
        self.verify_h, self.verify_pos = h, start

    def accept_rows(self, n_accepted: int) -> bool:
        """The last forward's first `n_accepted` drafts were accepted: the row after them is pending.
        False where no forward was seen."""
        if self.verify_h is None:
            return False
        i = min(int(n_accepted), len(self.verify_h) - 1)
        self.pending_h, self.pending_pos = self.verify_h[i], self.verify_pos + i
        return True


def final_hidden_rows(out: SeqOutput, drafter: str, backend_name: str, reads: str) -> np.ndarray:
    """A float32 copy of a target forward's hidden rows after output_norm (kept past the forward, for
    accept()); a ConfigError ending "which {reads}" where the backend did not return them."""
    if out.hidden_final is None:
        raise ConfigError(f"{drafter}: the {backend_name} backend did not return the target's hidden states "
                          f"after output_norm, which {reads}")
    return np.array(out.hidden_final, dtype=np.float32)


class SeqRuntime(Protocol):
    """The sequence side of a draft runtime (DraftRuntime, MtpRuntime)."""

    def new_seq(self) -> int: ...

    def free_seq(self, seq_id: int) -> None: ...

    def truncate(self, seq_id: int, n_keep: int) -> None: ...

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None: ...


def shift_slot_cache(runtime: SeqRuntime, st: HiddenSlot, n_keep: int, n_discard: int) -> None:
    """Follow a context shift of the target (positions [n_keep, n_keep + n_discard) gone, later ones
    down by n_discard) in a slot's draft cache, whose positions are target positions minus `st.offset`
    (the forwards missed while resting). Missed forwards come after the prompt: cache positions below
    n_keep are taken as the target's, and the missed span as the first part of what is discarded."""
    length = runtime.seq_len(st.seq)
    if length + st.offset <= n_keep:
        return  # the cache ends before the discarded span
    keep = min(n_keep, length)
    drop = min(max(n_discard - st.offset, 0), length - keep)
    runtime.shift(st.seq, keep, drop)
    st.offset = max(0, st.offset - n_discard + drop)


def shifted_position(pos: int, n_keep: int, n_discard: int) -> int | None:
    """Where target position `pos` is after a context shift; None when it was discarded."""
    if pos < n_keep:
        return pos
    return None if pos < n_keep + n_discard else pos - n_discard


SeqRuntimeT = TypeVar("SeqRuntimeT", bound=SeqRuntime)
RuntimeT = TypeVar("RuntimeT", bound=DraftRuntime)
SlotT = TypeVar("SlotT", bound=HiddenSlot)


class SlotDrafter(ABC, Generic[SeqRuntimeT, SlotT]):
    """Slot bookkeeping for a drafter with one draft-runtime sequence per slot.

    Subclasses name their slot type in `new_slot` and implement create/capture/observe/accept/draft.
    """

    name: ClassVar[str]
    model_based: ClassVar[bool] = True

    def __init__(self, runtime: SeqRuntimeT) -> None:
        self.runtime = runtime
        self._slots: SlotStates[SlotT] = SlotStates(lambda _slot: self.new_slot(self.runtime.new_seq()))

    @abstractmethod
    def new_slot(self, seq: int) -> SlotT:
        """Fresh state for a slot whose draft-runtime sequence is `seq`."""

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        # The prompt was already mirrored by observe (which runs before begin); only reset sampling.
        st = self._slots.get(slot)
        st.rng, st.rng_key = None, None

    def end(self, slot: int) -> None:
        st = self._slots.pop(slot)
        if st is not None:
            self.runtime.free_seq(st.seq)

    @staticmethod
    def probabilistic(st: HiddenSlot, r: DraftRequest) -> bool:
        """Whether `r` drafts by sampling; if so, `st.rng` is seeded for its (temperature, seed).

        The sampler is kept across rounds of one request so its draws continue, and re-seeded only
        when a request brings another temperature or seed (or after begin()).
        """
        if r.spec.draft_sampling != "probabilistic" or r.temperature <= 0:
            return False
        if st.rng is None or st.rng_key != (r.temperature, r.seed):
            st.rng, st.rng_key = draft_rng("probabilistic", r.temperature, r.seed), (r.temperature, r.seed)
        return True


class HiddenStateDrafter(SlotDrafter[RuntimeT, SlotT]):
    """A slot drafter fed by the target's captured layers."""

    def __init__(self, runtime: RuntimeT) -> None:
        super().__init__(runtime)
        self.layers = runtime.info.target_layers

    def capture(self) -> Capture:
        return Capture(layers=frozenset(self.layers))

    def features(self, out: SeqOutput) -> np.ndarray:
        """The captured layer inputs of one target forward, side by side: [rows, len(layers) * H]."""
        missing = [layer for layer in self.layers if layer not in out.layer_inputs]
        if missing:
            raise ConfigError(f"{self.name}: the target did not return captured layers {missing}")
        return np.concatenate([out.layer_inputs[layer] for layer in self.layers], axis=1)


@dataclass(slots=True)
class DraftRun:
    """One request's draft, grown a token a step until `cap` tokens or a token below `p_min`."""

    index: int  # the request's index in draft()'s list
    slot: HiddenSlot
    last: int  # x, the token the draft follows
    start: int  # the draft-runtime sequence is cut back to this length once drafting ends
    cap: int
    p_min: float
    temperature: float
    probabilistic: bool
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    # The policy's rule for drafting on (DraftRequest.keep_drafting): None drafts up to `cap`.
    keep_drafting: Callable[[Sequence[float]], bool] | None = None

    def take(self, logits: np.ndarray, vocab: np.ndarray | None = None, n_vocab: int = 0) -> bool:
        """Choose the next token from `logits` (best, or sampled by the slot's rng; a row over a reduced
        vocabulary names its columns' ids and the whole width, as `choose` takes them); False, dropping
        it, when it is not confident enough: this run stops."""
        c = choose(logits, self.temperature, self.slot.rng if self.probabilistic else None, vocab=vocab,
                   n_vocab=n_vocab)
        if c.p_top < self.p_min:
            return False
        self.tokens.append(c.token)
        self.confidence.append(c.p_top)
        if c.q is not None:
            self.probs.append(c.q)
        return True

    @property
    def full(self) -> bool:
        """Drafted enough: at its cap, or where the policy says no further token could be verified."""
        return len(self.tokens) >= self.cap or (self.keep_drafting is not None and not self.keep_drafting(self.confidence))


def finish_drafts(runtime: SeqRuntime, requests: Sequence[DraftRequest], runs: Sequence[DraftRun]) -> list[Draft]:
    """Each request's draft (empty where it drafted nothing or fewer than n_min tokens); the drafted
    entries are dropped from the runtime's caches, since they are rewritten from the target."""
    result = [Draft.empty() for _ in requests]
    for run in runs:
        runtime.truncate(run.slot.seq, run.start)
        if run.tokens and len(run.tokens) >= int(requests[run.index].spec.n_min):
            probs = np.stack(run.probs) if run.probabilistic and run.probs else None
            result[run.index] = Draft(run.tokens, probs, run.confidence)
    return result
