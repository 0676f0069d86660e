"""The one typed Drafter protocol every speculative technique implements (one file each in drafters/).

Lifecycle per slot (a slot is one concurrent request's place in the engine):
  begin(slot, prompt)  once the prompt is known (before any draft)
  draft([...])         once per round for every slot still looking for a draft (batched: model
                       drafters decode all slots together); an empty Draft falls through to the next
                       drafter in priority order
  observe(slot, ...)   after every target forward that included this slot (llama.cpp's `process`):
                       model drafters mirror the target batch / read captured hidden states
  accept(slot, n, mine) after verification; `mine` is True when this drafter's draft was verified
  end(slot)            the request finished; free per-slot state

Optional: shortened(slot, n_kept) is called, when a drafter defines it, after the engine's cost
model decided to verify only the first n_kept tokens of this round's draft (0: none), before
accept(); a drafter whose accept() judges its draft by its length uses it.

Optional: a model drafter that can miss forwards declares ``resumes: ClassVar[bool] = True``. While
the slot's draft policy rests it (DraftPolicy.resting: it will not be asked for the slot in the next
rounds), the engine neither captures hidden states for it nor calls its observe() or accept() for
that slot's generating rounds; the next forward it observes starts after a gap, and its context goes
on from there (the positions in between are left out of its own cache). Prompt chunks are always
observed. A drafter without the flag observes every forward.

Optional: a model drafter whose own caches are kept by position declares
``follows_context_shift: ClassVar[bool] = True`` when it follows a context shift (without it a server
with --context-shift refuses it); it may define ``shifted(slot, n_keep, n_discard)``, which the engine
calls right after the slot's target cache and history shifted (core/engine/context_shift.py), before
the next draft: the positions [n_keep, n_keep + n_discard) left and the later ones moved down by n_discard.

Optional: a drafter that keeps per-slot state between requests which the next request's history does
not rebuild (``description.slot_state == "saved"``: n-gram tables, acceptance counters) defines
``save_slot(slot) -> dict[str, np.ndarray] | None`` (None: it holds nothing for the slot) and
``load_slot(slot, arrays)``, which makes `arrays` (a save_slot's, possibly of another slot or process)
the slot's state, or forgets the slot's state when `arrays` is None; arrays it cannot take are a
ConfigError, raised before anything changes. Slot files carry them (core/engine/slot_actions.py).
The engine calls both only between steps, for an idle slot.

A drafter instance is shared by all slots of an engine (ngram-mod's pool is global on purpose).
Drafters are found through the ``spekula.drafters`` entry-point group; the entry point names a class
with ``create(ctx) -> Drafter``. A drafter with a length cap of its own (docs/semantics.md §1.3: size_m,
ngram-mod's n_max, ngram-cache's 8) declares it as an int attribute ``draft_cap``; without one the
engine takes --spec-draft-n-max, the model drafters' cap. A drafter declares its options, its place
in the built-in order and what it needs as ``description: ClassVar[DrafterDescription]``
(core/drafting/description.py); one without a description has no options of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from spekula.core.backend import Backend, BackendOptions, Capture, SeqInput, SeqOutput
from spekula.core.drafting.description import DrafterOption, OptionValue
from spekula.core.params import SpecParams

if TYPE_CHECKING:
    from spekula.core.modelfile.tokenizer import Tokenizer


@dataclass(slots=True)
class DraftRequest:
    slot: int
    history: np.ndarray  # int32 H: prompt + accepted tokens, *excluding* `last` (a view: do not mutate)
    last: int  # x: the most recent target token; not yet in any KV cache; at position len(history)
    n_max: int  # n_draft_max: context / n_predict budget; the drafter applies its own cap as well
    spec: SpecParams  # this request's effective parameters
    temperature: float
    seed: int
    # The slot's policy's rule for drafting on (a model drafter that drafts token by token): given the
    # confidences of the tokens drafted so far, whether a further token could still be worth its draft
    # step and verification row. None: draft up to n_max. A drafter may ignore it (the cut still sizes
    # what is verified); one that follows it saves the steps the cut would throw away.
    keep_drafting: Callable[[Sequence[float]], bool] | None = None


@dataclass(slots=True)
class Draft:
    tokens: list[int]
    # float32 [len(tokens), n_vocab] draft distributions q, only from probabilistic model drafting;
    # enables rejection-sampling verification at temperature > 0.
    probs: np.ndarray | None = None
    # A model drafter's own probability for each token it chose (its weight among the candidates it
    # chose from); the adaptive planner calibrates it against outcomes (core/policy/confidence.py). None for
    # draftless drafters, which have no such number.
    confidence: list[float] | None = None

    def prefix(self, n: int) -> Draft:
        """The first n tokens, with their probabilities and confidences."""
        return Draft(list(self.tokens[:n]), None if self.probs is None else self.probs[:n],
                     None if self.confidence is None else self.confidence[:n])

    @staticmethod
    def empty() -> Draft:
        return Draft([])


@dataclass(slots=True)
class DrafterContext:
    """What a drafter factory may use to build itself."""

    spec: SpecParams  # server-wide speculation options (drafter_options holds per-drafter ones)
    target: Backend  # the target model's backend (model drafters read info and captured hiddens)
    tokenizer: Tokenizer | None
    n_seq_max: int
    backend_name: str = "torch"
    draft_backend_options: BackendOptions | None = None  # --spec-draft-device/-dtype/-threads
    draft_model_path: str | None = None  # -md / --spec-draft-model

    def option(self, name: str, default: Any) -> Any:
        """A per-drafter option by llama.cpp name without dashes, e.g. 'spec-ngram-simple-size-n'."""
        value = self.spec.drafter_options.get(name)
        return default if value is None else type(default)(value)

    def value(self, option: DrafterOption, *, maximum: int | float | None = None) -> OptionValue | None:
        """A declared option's value (its default when not given), converted and range-checked."""
        return option.convert(self.spec.drafter_options.get(option.name), maximum=maximum)

    def int_value(self, option: DrafterOption, *, maximum: int | None = None) -> int:
        return int(self.value(option, maximum=maximum) or 0)

    def float_value(self, option: DrafterOption) -> float:
        return float(self.value(option) or 0.0)

    def text_value(self, option: DrafterOption) -> str:
        """A str option's value, "" when unset."""
        return str(self.value(option) or "")


@runtime_checkable
class Drafter(Protocol):
    name: ClassVar[str]  # llama.cpp's type name, e.g. "ngram-mod"
    model_based: ClassVar[bool]  # False for draftless (n-gram) drafters: they take precedence

    @classmethod
    def create(cls, ctx: DrafterContext) -> Drafter: ...

    def capture(self) -> Capture:
        """Hidden states this drafter needs from every target forward (empty for n-gram drafters)."""
        ...

    def begin(self, slot: int, prompt: np.ndarray) -> None: ...

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]: ...

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None: ...

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None: ...

    def end(self, slot: int) -> None: ...


class DraftlessDrafter:
    """Convenience base for n-gram drafters: no capture, no observe. Subclasses still declare `Drafter`."""

    model_based: ClassVar[bool] = False

    def capture(self) -> Capture:
        return Capture()

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        return None

    def end(self, slot: int) -> None:
        return None
