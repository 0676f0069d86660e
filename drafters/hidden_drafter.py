"""What the hidden-state drafters (draft-eagle3, draft-dflash, draft-dspark) share.

Both read the target's captured layer inputs, keep one draft-runtime sequence per slot and a
per-request probabilistic sampler; this module holds that bookkeeping once, and the option and
path rules for loading their draft model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import ClassVar, Generic, TypeVar

import numpy as np

from spekula.core.backend import BackendOptions, Capture, SeqOutput
from spekula.core.draft_models import DraftRuntime, draft_rng
from spekula.core.drafter import DrafterContext, DraftRequest
from spekula.core.errors import ConfigError
from spekula.core.slot_states import SlotStates


def model_draft_options(ctx: DrafterContext, extra_ctx: int = 0) -> BackendOptions:
    """Draft runtime options: the target's device/dtype unless --spec-draft-* said otherwise, one
    sequence per slot, and the target's context (plus room for a draft block beyond it)."""
    base = ctx.draft_backend_options or ctx.target.options
    return replace(base, n_ctx=ctx.target.n_ctx + extra_ctx, n_seq_max=max(ctx.n_seq_max, 1))


def require_draft_path(ctx: DrafterContext, name: str) -> str:
    if not ctx.draft_model_path:
        raise ConfigError(f"{name} needs a draft model: pass -md/--spec-draft-model FILE.gguf")
    return str(ctx.draft_model_path)


@dataclass(slots=True)
class HiddenSlot:
    seq: int  # the slot's sequence in the draft runtime
    rng: np.random.Generator | None = None
    rng_key: tuple[float, int] | None = None  # (temperature, seed) rng was seeded for


RuntimeT = TypeVar("RuntimeT", bound=DraftRuntime)
SlotT = TypeVar("SlotT", bound=HiddenSlot)


class HiddenStateDrafter(ABC, Generic[RuntimeT, SlotT]):
    """Slot bookkeeping for a drafter fed by the target's captured layers.

    Subclasses name their slot type in `new_slot` and implement create/observe/accept/draft.
    """

    name: ClassVar[str]
    model_based: ClassVar[bool] = True

    def __init__(self, runtime: RuntimeT) -> None:
        self.runtime = runtime
        self.layers = runtime.info.target_layers
        self._slots: SlotStates[SlotT] = SlotStates(lambda _slot: self.new_slot(self.runtime.new_seq()))

    @abstractmethod
    def new_slot(self, seq: int) -> SlotT:
        """Fresh state for a slot whose draft-runtime sequence is `seq`."""

    def capture(self) -> Capture:
        return Capture(layers=frozenset(self.layers))

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        # The prompt was already mirrored by observe (which runs before begin); only reset sampling.
        st = self._slots.get(slot)
        st.rng, st.rng_key = None, None

    def end(self, slot: int) -> None:
        st = self._slots.pop(slot)
        if st is not None:
            self.runtime.free_seq(st.seq)

    def features(self, out: SeqOutput) -> np.ndarray:
        """The captured layer inputs of one target forward, side by side: [rows, len(layers) * H]."""
        missing = [layer for layer in self.layers if layer not in out.layer_inputs]
        if missing:
            raise ConfigError(f"{self.name}: the target did not return captured layers {missing}")
        return np.concatenate([out.layer_inputs[layer] for layer in self.layers], axis=1)

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
