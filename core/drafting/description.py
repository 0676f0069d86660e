"""What a drafter declares about itself, so nothing outside its own module repeats it.

A drafter class carries a ``description: ClassVar[DrafterDescription]``: its options (name, type,
default, range, help, spellings, llama-server's environment variable), its place in spekula's fixed
built-in order, and what it needs from the target. The CLI options of ``spekula`` and
``spekula-server``, docs/drafters.md and the priority order (docs/semantics.md §3) are all built
from these descriptions. The precedence class stays the Drafter protocol's ``model_based`` flag,
which the engine reads from instances.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from spekula.core.errors import ConfigError

if TYPE_CHECKING:
    from spekula.core.modelfile.gguf_file import GGUFFile

OptionValue = int | float | str
OptionType = type[int] | type[float] | type[str]
# Whether a drafter reads a draft GGUF (-md / --spec-draft-model): never, when one is given (else it
# finds its weights elsewhere: a shipped head, the target's own file), or always.
DraftModelUse = Literal["none", "optional", "required"]
# What a drafter keeps per slot from one request to the next (slot files, core/engine/slot_actions.py):
# nothing; only what the next request's history rebuilds (a slot restored from a file drafts as the saved
# one would have, with nothing saved); or state no history rebuilds (tables, counters), which the drafter
# hands to slot files through save_slot / load_slot (core/drafting/drafter.py).
SlotStateUse = Literal["none", "history", "saved"]


@dataclass(frozen=True, slots=True)
class DrafterOption:
    """One per-drafter option; its value lands in ``SpecParams.drafter_options[name]``."""

    name: str  # the long option without its dashes, e.g. "spec-ngram-simple-size-n"
    type: OptionType
    default: OptionValue | None  # None: unset (only for str options, e.g. a file to read)
    help: str
    aliases: tuple[str, ...] = ()  # other spellings, dashes included, e.g. ("-lcs",)
    llama_cpp: bool = False  # llama-server has it under these spellings: spekula-server translates it
    env: str | None = None  # llama-server's LLAMA_ARG_* variable for it, where it has one
    minimum: int | float | None = None
    maximum: int | float | None = None
    minimum_open: bool = False  # the minimum itself is out of range: (minimum, maximum]
    metavar: str = "N"

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def spellings(self) -> tuple[str, ...]:
        return (*self.aliases, self.flag)

    def range_text(self, maximum: int | float | None = None) -> str:
        """The range as error messages and docs print it ("" when unbounded)."""
        hi = self.maximum if maximum is None else maximum
        if self.minimum is None:
            return "" if hi is None else f"<= {hi}"
        if hi is None:
            return f"> {self.minimum}" if self.minimum_open else f">= {self.minimum}"
        return f"{'(' if self.minimum_open else '['}{self.minimum}, {hi}]"

    def convert(self, raw: object, *, maximum: int | float | None = None) -> OptionValue | None:
        """A given value (CLI text, JSON value or already typed; None: the default), converted and
        range-checked; ``maximum`` narrows the declared one when it depends on another option."""
        if raw is None:
            return self.default
        if self.type is str:
            return str(raw)
        try:
            value: int | float = self.type(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            what = "an integer" if self.type is int else "a number"
            raise ConfigError(f"{self.flag}: expected {what}, got {raw!r}") from None
        hi = self.maximum if maximum is None else maximum
        low = self.minimum is not None and (value < self.minimum or (self.minimum_open and value == self.minimum))
        if (isinstance(value, float) and not math.isfinite(value)) or low or (hi is not None and value > hi):
            raise ConfigError(f"{self.flag} must be in {self.range_text(maximum)}, got {value}")
        return value


@dataclass(frozen=True, slots=True)
class DrafterDescription:
    """Everything about a drafter that the CLI, the docs and the priority order need, without an instance."""

    summary: str  # one line, for docs/drafters.md
    options: tuple[DrafterOption, ...] = ()
    # spekula's own drafters: their rank in the fixed order (docs/semantics.md §3); None for third-party
    # ones, which rank by name after the built-in ones of their precedence class.
    builtin_order: int | None = None
    hidden_states: bool = False  # reads the target's hidden states (captured every forward)
    draft_model: DraftModelUse = "none"
    spec_default: bool = False  # --spec-default enables it, its options at their defaults
    slot_state: SlotStateUse = "history"  # what it keeps per slot between requests (SlotStateUse)
    # A draft GGUF given without --spec-type means this type when this returns True (llama.cpp's inference).
    implied_by: Callable[[GGUFFile], bool] | None = None
    # Checks of the files (target path, draft path or None) from their headers alone, before any weights load.
    check_files: Callable[[str, str | None], None] | None = None

    def option(self, name: str) -> DrafterOption:
        for opt in self.options:
            if opt.name == name:
                return opt
        raise KeyError(name)


UNDESCRIBED = DrafterDescription(summary="")  # what a third-party drafter without a description declares
