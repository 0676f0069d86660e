"""ngram-map-k and ngram-map-k4v: a per-slot map from key n-grams to what followed them.

Both follow llama.cpp's `common_ngram_map_*` (docs/semantics.md §2.2): a 262144-bucket hash
index of history positions (first writer wins), key records with hit counts, and per-value
accepted-length tracking that caps later drafts from the same key. k4v also counts up to four
distinct m-token values per key and drafts only when one is "significantly more frequent".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Self

import numpy as np

from spekula.core.drafting.description import DrafterDescription
from spekula.core.drafting.drafter import Drafter, DrafterContext
from spekula.core.drafting.slot_states import SlotStates, state_array
from spekula.core.errors import ConfigError
from spekula.drafters.draftless import ngram_lookup
from spekula.drafters.draftless.ngram_lookup import last_match
from spekula.drafters.draftless.ngram_match import (
    SlotDraftless,
    match_positions,
    ngram_size_options,
    same_tokens,
)

KEY_MAP_SIZE = 262144  # buckets in the hash -> history-index map
LCG32 = 2654435761  # near (sqrt(5)-1)/2 * 2**32
MAX_COUNT = 16380  # saturation of key_num / value_num
N_VALUES = 4  # value slots per key (k4v)
_M32 = 0xFFFFFFFF
_SMALL_INDEX = 16  # new starts per round below which indexing stays in Python


def key_hash(tokens: Sequence[int]) -> int:
    """32-bit LCG hash of an n-gram: h = h * 2654435761 + t (mod 2**32)."""
    h = 0
    for t in tokens:
        h = (h * LCG32 + (int(t) & _M32)) & _M32
    return h


def window_buckets(hist: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """Bucket of the n-gram starting at each of `starts` (vectorised `key_hash` mod KEY_MAP_SIZE)."""
    h = np.zeros(starts.shape, dtype=np.uint32)
    for k in range(n):
        # uint32 arithmetic wraps exactly like the C++ uint32_t hash.
        h = h * np.uint32(LCG32) + hist[starts + k].astype(np.uint32)
    return h % np.uint32(KEY_MAP_SIZE)


@dataclass(slots=True)
class _Value:
    idx: int = 0  # history index where this m-token value starts; 0 = unused slot
    num: int = 0  # occurrences counted
    n_accepted: int = 0  # last accepted length of a draft made through this slot


@dataclass(slots=True)
class _Key:
    key_idx: int  # history index where the key was first matched
    tokens: tuple[int, ...]
    values: list[_Value]
    stat_idx: int = 0  # k4v statistics resume point
    key_num: int = 0  # successful lookups (not occurrences)


@dataclass
class _MapState:
    key_map: np.ndarray = field(default_factory=lambda: np.zeros(KEY_MAP_SIZE, dtype=np.uint32))
    key_map_last_idx: int = 0
    size_last_begin: int = 0
    idx_last_check: int = 0
    keys: list[_Key] = field(default_factory=list)
    seen: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # history at last call
    by_tokens: dict[tuple[int, ...], _Key] = field(default_factory=dict)
    last_value: _Value | None = None  # the value slot the last draft came from (for accept)
    kept: int | None = None  # the engine verified only this many tokens of the last draft


class _NgramMapDrafter(SlotDraftless):
    """Shared map logic; the two public classes differ in `key_only` and their option names.

    Differences from llama.cpp, for both:
      * begin() also cleans up when the new prompt differs from the slot's previous history (from
        n+m tokens before the first difference), not only when it is shorter. llama.cpp keeps
        index entries of the old text there, and after a longer earlier request on the slot it
        never indexes the first S-n-m positions of a new, different prompt at all, so text in
        the prompt (e.g. a paragraph to repeat) is never drafted from.
      * Starts in [S-n-m, S] (S = prompt length) are indexed on the first draft; llama.cpp leaves
        them out until the next begin().
      * A history shorter than the last one seen inside a request (a context shift) cleans the
        map up as begin() would, where llama.cpp aborts the process.
    """

    key_only: ClassVar[bool]
    description: ClassVar[DrafterDescription]

    def __init__(self, size_n: int = 12, size_m: int = 48, min_hits: int = 1) -> None:
        self.n = size_n
        self.m = size_m
        self.min_hits = min_hits
        self._slots: SlotStates[_MapState] = SlotStates(lambda _slot: _MapState())

    @classmethod
    def create(cls, ctx: DrafterContext) -> Self:
        ngram_lookup.require()
        size_n, size_m, min_hits = (ctx.int_value(o) for o in cls.description.options)
        return cls(size_n, size_m, min_hits)

    @property
    def draft_cap(self) -> int:
        return self.m

    # -- begin: clean up after the history shrank ----------------------------------------------

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        st = self._slots.get(slot)
        self._cleanup(st, prompt)
        st.size_last_begin = len(prompt)
        st.seen = np.array(prompt, copy=True)

    def _cleanup(self, st: _MapState, hist: np.ndarray) -> None:
        """Drop index entries, keys and values that a shorter or rewritten history invalidates."""
        n, m = self.n, self.m
        size = len(hist)
        common = min(len(st.seen), size)
        diff = np.flatnonzero(st.seen[:common] != hist[:common])
        changed = diff.size > 0
        c = st.size_last_begin
        if c > size:
            c = size - n - m if size > n + m else 0
        if changed:
            # Everything that reads a token at or after the first difference is stale.
            c = min(c, max(int(diff[0]) - n - m, 0))
        if size < st.idx_last_check or changed:
            st.key_map[st.key_map >= c] = 0
            st.key_map_last_idx = max(c - 1, 0)
            kept: list[_Key] = []
            for key in st.keys:
                if key.key_idx >= c:
                    continue
                if not self.key_only:
                    live = [v for v in key.values if v.idx != 0 and v.idx < c]
                    if not live:
                        continue
                    key.values = live + [_Value(n_accepted=m) for _ in range(N_VALUES - len(live))]
                kept.append(key)
            st.keys = kept
            st.by_tokens = {}
            for key in kept:
                st.by_tokens.setdefault(key.tokens, key)
            st.last_value = None
        st.idx_last_check = size

    # -- draft -----------------------------------------------------------------------------------

    def draft_one(self, slot: int, hist: np.ndarray, last: int) -> list[int]:
        st = self._slots.get(slot)
        st.last_value = None
        n, m = self.n, self.m
        length = len(hist)
        if length < 2 * n + m:
            return []
        if length < st.idx_last_check:
            # The history shrank without a begin (context shift): clean up as begin would.
            self._cleanup(st, hist)
            st.size_last_begin = length
        st.idx_last_check = length
        st.seen = np.array(hist, copy=True)

        key = tuple(int(t) for t in hist[length - n + 1 :]) + (int(last),)
        top = length - n - m - 1  # the highest start with m+1 tokens after the key
        p = 0
        hashed = int(st.key_map[key_hash(key) % KEY_MAP_SIZE])
        if hashed != 0 and hashed < top and same_tokens(hist, hashed, key):
            p = hashed
        old_hi = st.size_last_begin - n - m - 1  # the range begin() left unindexed, below...
        old_lo = st.key_map_last_idx + 1
        new_lo = max(old_hi, st.key_map_last_idx) + 1  # ...and everything above it
        if p == 0 and st.size_last_begin > n + m + 1:
            p = max(last_match(hist, key, old_lo, old_hi), 0)
        if p == 0:
            p = max(last_match(hist, key, new_lo, top), 0)
        self._index(st, hist, old_lo, old_hi if st.size_last_begin > n + m + 1 else 0, new_lo, top)
        if p == 0:
            return []

        rec = st.by_tokens.get(key)
        if rec is None:
            rec = _Key(key_idx=p, tokens=key, values=[_Value(n_accepted=m) for _ in range(N_VALUES)])
            st.keys.append(rec)
            st.by_tokens[key] = rec
        rec.key_num = min(rec.key_num + 1, MAX_COUNT)
        if rec.key_num < self.min_hits:
            return []
        if self.key_only:
            value = rec.values[0]
        else:
            value = self._count_values(rec, hist, key, p)
            if value is None:
                return []
        st.last_value, st.kept = value, None
        c = min(m, value.n_accepted)
        return hist[p + n : p + n + c].tolist()

    def _index(self, st: _MapState, hist: np.ndarray, lo1: int, hi1: int, lo2: int, hi2: int) -> None:
        """Store each start of [hi1..lo1] then [hi2..lo2] (descending) in its bucket if it is empty."""
        ranges = [(lo, hi) for lo, hi in ((lo1, hi1), (lo2, hi2)) if hi >= lo]
        count = sum(hi - lo + 1 for lo, hi in ranges)
        if 0 < count <= _SMALL_INDEX:
            # The usual round adds a token or a few: plain Python beats numpy's per-call overhead.
            key_map = st.key_map
            for lo, hi in ranges:
                window = hist[lo : hi + self.n].tolist()
                for j in range(hi, lo - 1, -1):
                    b = key_hash(window[j - lo : j - lo + self.n]) % KEY_MAP_SIZE
                    if key_map[b] == 0:
                        key_map[b] = j
        elif count:
            starts = np.concatenate([np.arange(hi, lo - 1, -1, dtype=np.int64) for lo, hi in ranges])
            buckets = window_buckets(hist, starts, self.n)
            # np.unique keeps the first occurrence of each bucket, i.e. the first writer.
            uniq, first = np.unique(buckets, return_index=True)
            free = st.key_map[uniq] == 0
            st.key_map[uniq[free]] = starts[first[free]].astype(np.uint32)
        st.key_map_last_idx = max(len(hist) - self.n - self.m - 1, st.key_map_last_idx)

    def _count_values(self, rec: _Key, hist: np.ndarray, key: tuple[int, ...], p: int) -> _Value | None:
        """k4v statistics over occurrences in [stat_idx, p]; the winning slot, or None to not draft."""
        n, m = self.n, self.m
        for i in match_positions(hist, key, rec.stat_idx, p).tolist():
            start = i + n
            for v in rec.values:
                if v.idx == 0:
                    v.idx, v.num, v.n_accepted = start, 0, m
                elif not np.array_equal(hist[start : start + m], hist[v.idx : v.idx + m]):
                    continue
                v.num = min(v.num + 1, MAX_COUNT)
                break
        # llama.cpp rescans from p next time, so the occurrence at p is counted on every hit.
        rec.stat_idx = p
        best = rec.values[0]
        for v in rec.values[1:]:
            if v.num > best.num:
                best = v
        others = sum(v.num for v in rec.values) - best.num
        if others > 0 and best.num < 2 * others:
            return None
        return best

    # -- accept ------------------------------------------------------------------------------------

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        if not mine:
            return
        st = self._slots.peek(slot)
        if st is not None and st.last_value is not None:
            # Later drafts through this value are capped at what was accepted now, unless the
            # engine verified a shortened draft whole: that says nothing against the rest of it.
            if st.kept is not None and n_accepted >= st.kept:
                st.last_value.n_accepted = max(st.last_value.n_accepted, n_accepted)
            else:
                st.last_value.n_accepted = max(n_accepted, 0)

    def shortened(self, slot: int, n_kept: int) -> None:
        st = self._slots.peek(slot)
        if st is not None:
            st.kept = n_kept

    def end(self, slot: int) -> None:
        # Kept on purpose: like llama.cpp, the map survives between requests on a slot and the
        # next begin() cleans up only what a shorter history invalidates.
        return None

    # -- slot files: the map as arrays (Drafter.save_slot / load_slot) ------------------------------

    def save_slot(self, slot: int) -> dict[str, np.ndarray] | None:
        st = self._slots.peek(slot)
        if st is None:
            return None
        keys = st.keys
        return {
            "config": np.array([self.n, self.m, int(self.key_only)], np.int64),
            "cursors": np.array([st.key_map_last_idx, st.size_last_begin, st.idx_last_check], np.int64),
            "key_map": st.key_map.copy(), "seen": np.asarray(st.seen, np.int32).copy(),
            "key_tokens": np.array([k.tokens for k in keys], np.int32).reshape(len(keys), self.n),
            "key_fields": np.array([(k.key_idx, k.stat_idx, k.key_num) for k in keys], np.int64).reshape(len(keys), 3),
            "values": np.array([[(v.idx, v.num, v.n_accepted) for v in k.values] for k in keys],
                               np.int64).reshape(len(keys), N_VALUES, 3),
        }

    def load_slot(self, slot: int, arrays: dict[str, np.ndarray] | None) -> None:
        if arrays is None:
            self._slots.pop(slot)
            return
        config = state_array(arrays, "config", np.int64, (3,)).tolist()
        if config != [self.n, self.m, int(self.key_only)]:
            raise ConfigError(f"the saved {self.name} state is of size-n {config[0]}, size-m {config[1]}; this "
                              f"drafter's are {self.n}, {self.m}")
        tokens = state_array(arrays, "key_tokens", np.int32, (None, self.n))
        fields = state_array(arrays, "key_fields", np.int64, (tokens.shape[0], 3))
        values = state_array(arrays, "values", np.int64, (tokens.shape[0], N_VALUES, 3))
        last_idx, last_begin, last_check = (int(v) for v in state_array(arrays, "cursors", np.int64, (3,)))
        st = _MapState(key_map=state_array(arrays, "key_map", np.uint32, (KEY_MAP_SIZE,)).copy(),
                       key_map_last_idx=last_idx, size_last_begin=last_begin, idx_last_check=last_check,
                       seen=state_array(arrays, "seen", np.int32, (None,)).copy())
        for toks, (key_idx, stat_idx, key_num), vals in zip(tokens.tolist(), fields.tolist(), values.tolist(),
                                                             strict=True):
            key = _Key(key_idx, tuple(toks), [_Value(*v) for v in vals], stat_idx, key_num)
            st.keys.append(key)
            st.by_tokens.setdefault(key.tokens, key)
        self._slots.put(slot, st)


class NgramMapKDrafter(_NgramMapDrafter, Drafter):
    """ngram-map-k: draft the continuation after an earlier occurrence of the key n-gram.

    Options (llama.cpp names): ``description`` below.

    A draft is at most the key's last accepted length: after an accept of 0 the key never drafts
    again until a begin() cleanup removes it.

    Differences from llama.cpp: those of both map drafters (see `_NgramMapDrafter`), and
      * ``min-hits`` works (llama.cpp returns before the test for key-only maps); the default 1
        gives identical drafts.
    """

    name: ClassVar[str] = "ngram-map-k"
    key_only: ClassVar[bool] = True
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="draft what followed an earlier occurrence of the key n-gram, capped by its last accepted length",
        options=ngram_size_options("spec-ngram-map-k", "n, key length", "m, longest draft",
                                   "successful lookups of the key before it drafts"),
        builtin_order=1,
        slot_state="saved",  # the map and its counts outlive a request
    )


class NgramMapK4vDrafter(_NgramMapDrafter, Drafter):
    """ngram-map-k4v: like ngram-map-k, but counts up to four distinct m-token values per key.

    Options (llama.cpp names): ``description`` below.

    It drafts only when the most frequent value is "significantly more frequent": the other
    slots sum to 0, or the best count is at least twice their sum. As in llama.cpp, the draft is
    the continuation at the matched position (the winner only gates the draft and caps its
    length), and the occurrence at the previous match is counted again on every hit.

    Differences from llama.cpp: those of both map drafters (see `_NgramMapDrafter`).
    """

    name: ClassVar[str] = "ngram-map-k4v"
    key_only: ClassVar[bool] = False
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="as ngram-map-k, drafting only when one of up to four values per key is clearly the most frequent",
        options=ngram_size_options("spec-ngram-map-k4v", "n, key length", "m, value length and longest draft",
                                   "successful lookups of the key before it drafts"),
        builtin_order=2,
        slot_state="saved",  # the map and its counts outlive a request
    )
