"""ngram-mod: one fixed hash table of n-gram successors, shared by every slot of the engine.

llama.cpp's `common_ngram_mod` + its speculative wrapper (docs/semantics.md §2.3): 4Mi int32
entries (16 MiB), indexed by a 64-bit LCG hash of the last n tokens, storing the token that
followed (last writer wins, no verification). Drafting walks the table from (H, x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from spekula.core.drafting.description import DrafterDescription, DrafterOption
from spekula.core.drafting.drafter import Drafter, DrafterContext
from spekula.core.drafting.slot_states import SlotStates, state_array
from spekula.drafters.draftless import ngram_lookup
from spekula.drafters.draftless.ngram_lookup import mod_add_range, mod_walk, mod_walk_after
from spekula.drafters.draftless.ngram_match import SlotDraftless

POOL_SIZE = 4 * 1024 * 1024
EMPTY = -1
# The table index of an n-gram is r = r * 6364136223846793005 + t (mod 2**64) over its tokens,
# low 22 bits; indexing and the walk run in C (drafters/draftless/ngram_lookup.py), rolling that hash along
# the window.
OCCUPANCY_RESET = 0.25  # begin(): wipe the pool above this fill fraction
LOW_ACCEPT_FRACTION = 0.25  # accept(): a round below this fraction counts as "low"
LOW_ACCEPT_ROUNDS = 5  # consecutive low rounds that wipe the pool
INDEX_CHUNK = 32  # draft(): index new history only once more than this many tokens arrived


class NgramPool:
    """The shared successor table: idx(n-gram) -> next token, EMPTY when unknown."""

    def __init__(self, n: int, size: int = POOL_SIZE) -> None:
        if size != POOL_SIZE:
            raise ValueError("the hash arithmetic assumes the llama.cpp pool size")
        self.n = n
        self.entries = np.full(size, EMPTY, dtype=np.int32)
        self.used = 0

    def add_range(self, hist: np.ndarray, lo: int, hi: int) -> None:
        """add(w) for every window start in [lo, hi): entries[idx(H[i:i+n])] = H[i+n], in order."""
        if hi > lo:
            self.used += mod_add_range(self.entries, hist, lo, hi, self.n, EMPTY)

    def walk(self, window: np.ndarray, n_min: int, n_max: int) -> list[int]:
        """Follow the table from the n-gram `window` for up to n_max tokens; [] when an empty entry
        comes before n_min tokens."""
        return mod_walk(self.entries, window, n_min, n_max, EMPTY)

    def walk_after(self, hist: np.ndarray, last: int, n_min: int, n_max: int) -> list[int]:
        """walk() from the n-gram made of the last n - 1 tokens of `hist` and `last`."""
        return mod_walk_after(self.entries, hist, last, self.n, n_min, n_max, EMPTY)

    def occupancy(self) -> float:
        return self.used / len(self.entries)

    def reset(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0


@dataclass(slots=True)
class _SeqInfo:
    i_last: int = 0  # history below this start index is in the pool
    n_draft_last: int = 0  # length of the last draft before the round cap
    n_low: int = 0  # consecutive low-acceptance rounds


class NgramModDrafter(SlotDraftless, Drafter):
    """ngram-mod: follow the shared successor table from the last n tokens of (H, x).

    Options (llama.cpp names): ``description`` below.

    One pool (16 MiB) serves every slot, so one request's text helps the others. begin() adds
    every prompt n-gram; draft() adds new history in chunks of more than 32 tokens; a draft is
    empty or has n_min <= k <= n_max tokens (before the round cap), except that n_min > n_max is
    accepted as llama.cpp accepts it and a full run of n_max tokens is then still a draft. Five consecutive verified
    drafts with less than a quarter accepted wipe the pool, as does a fill above 25% at begin().

    Differences from llama.cpp:
      * A wipe at begin() (fill above 25%) re-adds the prompt that was just indexed; llama.cpp
        wipes it too and does not rewind, so that request drafts from nothing.
      * Every wipe rewinds every slot's index, so each slot re-adds its own history at its next
        draft; llama.cpp rewinds only the slot that triggered a low-acceptance wipe and leaves
        the others' text out of the pool for the rest of their requests.
      * The low-acceptance threshold stays at 0.25, as llama.cpp's code has it (its comment says
        0.5): a wipe costs every slot its context, so it should take clearly bad rounds.
    """

    name: ClassVar[str] = "ngram-mod"
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="one hash table of n-gram successors shared by every slot, walked from the last n tokens",
        options=(
            DrafterOption("spec-ngram-mod-n-match", int, 24, "n-gram length hashed into the table", llama_cpp=True,
                          minimum=1, maximum=1024),
            DrafterOption("spec-ngram-mod-n-min", int, 48, "shortest draft worth making", llama_cpp=True,
                          minimum=0, maximum=1024),
            DrafterOption("spec-ngram-mod-n-max", int, 64, "longest draft", llama_cpp=True, minimum=0, maximum=1024),
        ),
        builtin_order=3,
        slot_state="saved",  # the low-acceptance count outlives a request
        spec_default=True,  # llama.cpp's --spec-default: ngram-mod with 24/48/64
    )

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64) -> None:
        self.n_match = n_match
        self.n_min = n_min
        self.n_max = n_max
        self.pool = NgramPool(n_match)
        self._slots: SlotStates[_SeqInfo] = SlotStates(lambda _slot: _SeqInfo())

    @property
    def draft_cap(self) -> int:
        return self.n_max

    @classmethod
    def create(cls, ctx: DrafterContext) -> NgramModDrafter:
        ngram_lookup.require()
        n_match, n_min, n_max = (ctx.int_value(o) for o in cls.description.options)
        return cls(n_match=n_match, n_min=n_min, n_max=n_max)

    def _wipe(self) -> None:
        self.pool.reset()
        for info in self._slots:
            info.i_last = 0

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        info = self._slots.get(slot)
        info.i_last = info.n_draft_last = 0
        n = self.n_match
        if len(prompt) < n:
            return
        self.pool.add_range(prompt, 0, len(prompt) - n)
        if self.pool.occupancy() > OCCUPANCY_RESET:
            self._wipe()
            self.pool.add_range(prompt, 0, len(prompt) - n)
        info.i_last = len(prompt) - n

    def draft_one(self, slot: int, hist: np.ndarray, last: int) -> list[int]:
        info = self._slots.get(slot)
        info.n_draft_last = 0
        n = self.n_match
        length = len(hist)
        if length < n:
            return []
        if info.i_last + INDEX_CHUNK < length:
            self.pool.add_range(hist, info.i_last, length - n)
            info.i_last = length - n
        # As llama.cpp (docs/semantics.md §2.3): n_min only rejects a walk that hits an empty
        # entry before n_min tokens. n_min <= n_max is not validated there, so with n_min > n_max a
        # walk that fills all n_max tokens is a draft shorter than n_min; keeping that keeps the same
        # drafts (and so the same acceptance statistics and pool wipes) as llama.cpp.
        drafted = self.pool.walk_after(hist, last, self.n_min, self.n_max)
        info.n_draft_last = len(drafted)
        return drafted

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        if not mine:
            return
        info = self._slots.get(slot)
        if info.n_draft_last <= 0:
            return
        if n_accepted / info.n_draft_last < LOW_ACCEPT_FRACTION:
            info.n_low += 1
            if info.n_low >= LOW_ACCEPT_ROUNDS:
                self._wipe()
                info.n_low = 0
        else:
            info.n_low = 0

    def shortened(self, slot: int, n_kept: int) -> None:
        # The low-acceptance rule judges the tokens that were verified, not the ones cut off.
        self._slots.get(slot).n_draft_last = n_kept

    def end(self, slot: int) -> None:
        # The slot's counters stay (llama.cpp keeps n_low across requests); begin() resets the rest.
        return None

    def save_slot(self, slot: int) -> dict[str, np.ndarray] | None:
        info = self._slots.peek(slot)
        return None if info is None else {"counters": np.array([info.i_last, info.n_draft_last, info.n_low], np.int64)}

    def load_slot(self, slot: int, arrays: dict[str, np.ndarray] | None) -> None:
        if arrays is None:
            self._slots.pop(slot)
            return
        i_last, n_draft_last, n_low = (int(v) for v in state_array(arrays, "counters", np.int64, (3,)))
        self._slots.put(slot, _SeqInfo(i_last, n_draft_last, n_low))
