"""ngram-cache: draft from n-gram statistics of the context, earlier generations and a corpus.

llama.cpp's `common_ngram_cache_*` + speculative wrapper (docs/semantics.md §2.4): three count
caches (context: built from this slot's history; dynamic: `-lcd FILE`; static: `-lcs FILE`, 2-grams
from a corpus). Each drafted token comes from the context cache with lax thresholds, else the
dynamic cache with strict ones, else the static cache alone; static counts re-weight candidates.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from spekula.core.drafting.description import DrafterDescription, DrafterOption
from spekula.core.drafting.drafter import Draft, Drafter, DrafterContext, DraftlessDrafter, DraftRequest
from spekula.core.drafting.slot_states import SlotStates, state_array
from spekula.core.errors import ConfigError, SpekulaError
from spekula.drafters.draftless.ngram_cache_file import (
    NGRAM_MAX,
    PAD,
    NgramCache,
    NgramCacheError,
    check_writable,
    load_cache,
    merge_cache,
    ngram_key,
    save_cache,
    update_cache,
)

log = logging.getLogger("spekula.drafters.draftless.ngram_cache")

N_DRAFT = 8  # fixed draft length (llama.cpp has no option for it)
# Per n-gram size 1..4: minimum sample count and minimum percentage of the best candidate.
MIN_SAMPLES_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLES_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)
_NO_COUNTS: dict[int, int] = {}


def _try_primary(
    cache: NgramCache,
    tail: Sequence[int],
    part_static: dict[int, int],
    min_samples: tuple[int, ...],
    min_percent: tuple[int, ...],
) -> int | None:
    """The best continuation of the longest usable n-gram (sizes 4 down to 1), or None."""
    for s in range(min(NGRAM_MAX, len(tail)), 0, -1):
        part = cache.get(ngram_key(tail[len(tail) - s :]))
        if part is None:
            continue
        best, best_count, best_weight, total = -1, 0, 0, 0
        for tok, count in part.items():
            # A token the corpus also saw after the last 2 tokens is weighted 100x its static count.
            weight = 100 * part_static[tok] if tok in part_static else 1
            if count * weight > best_count * best_weight:
                best, best_count, best_weight = tok, count, weight
            total += count
        # The share test uses the primary count: static data may pick, but not vouch for, a token.
        if total < min_samples[s - 1] or 100 * best_count < min_percent[s - 1] * total:
            continue
        return best
    return None


def _try_static(part_static: dict[int, int]) -> int | None:
    best, best_count, total = -1, 0, 0
    for tok, count in part_static.items():
        if count > best_count:
            best, best_count = tok, count
        total += count
    if total < MIN_SAMPLES_LAX[1] or 100 * best_count < MIN_PERCENT_LAX[1] * total:
        return None
    return best


def cache_draft(
    seq_tail: Sequence[int],
    n_draft: int,
    context: NgramCache,
    dynamic: NgramCache,
    static: NgramCache,
) -> list[int]:
    """Draft up to n_draft tokens after `seq_tail` (the last >= 2 tokens of H followed by x)."""
    tail = [int(t) for t in seq_tail[-NGRAM_MAX:]]
    if len(tail) < 2:
        return []
    drafted: list[int] = []
    while len(drafted) < n_draft:
        part_static = static.get((tail[-2], tail[-1], PAD, PAD), _NO_COUNTS) if static else _NO_COUNTS
        tok = _try_primary(context, tail, part_static, MIN_SAMPLES_LAX, MIN_PERCENT_LAX)
        if tok is None and dynamic:
            tok = _try_primary(dynamic, tail, part_static, MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT)
        if tok is None:
            tok = _try_static(part_static)
        if tok is None:
            break
        drafted.append(tok)
        tail.append(tok)
        del tail[0 : len(tail) - NGRAM_MAX]
    return drafted


@dataclass
class _SlotCache:
    seen: list[int] = field(default_factory=list)  # the (H, x) prefix already counted into context
    context: NgramCache = field(default_factory=dict)
    delta: NgramCache = field(default_factory=dict)  # this request's counts, for the dynamic cache


def _cache_rows(cache: NgramCache) -> np.ndarray:
    """int64 [rows, 6]: (the 4-slot key, token, count) per count, in the dicts' order (drafting breaks ties by it)."""
    rows = [(*key, tok, n) for key, part in cache.items() for tok, n in part.items()]
    return np.array(rows, np.int64).reshape(len(rows), NGRAM_MAX + 2)


def _cache_from_rows(rows: np.ndarray) -> NgramCache:
    cache: NgramCache = {}
    for k0, k1, k2, k3, tok, n in rows.tolist():
        cache.setdefault((k0, k1, k2, k3), {})[tok] = n
    return cache


class NgramCacheDrafter(DraftlessDrafter, Drafter):
    """ngram-cache: n-gram count caches of sizes 1..4, drafting up to 8 tokens.

    Options (llama.cpp names): ``description`` below.
    The draft length is fixed at 8 (llama.cpp has no option), then cut to the round's n_max.

    Differences from llama.cpp:
      * The context cache also counts n-grams that cross round boundaries (llama.cpp counts only
        those lying wholly inside each round's new tokens, so e.g. the 2-gram made of the last
        accepted token and the next x is never recorded). The worked example "H = [5,6,7,8,5,6],
        x = 7 gives [8, 5]" therefore drafts further here; `llama_compat_update=True` restores
        the old counting (used by the tests).
      * begin() rewinds the slot's high-water mark to the prefix the new prompt shares with what
        was counted before; llama.cpp never rewinds it, so a new request's tokens go uncounted
        until its history outgrows the previous one. Earlier counts stay, as in llama.cpp.
      * The dynamic cache is updated: at the end of each request the n-grams that request
        counted are merged into it (shared by all slots) and, if `lookup-cache-dynamic` names a
        file, the file is rewritten atomically. llama.cpp's server loads it and never saves it.
        A dynamic file that does not exist yet starts empty.
      * An unreadable or corrupt cache file is a clear NgramCacheError, not a process abort.
      * N-grams longer than the available history are skipped (llama.cpp reads before the start
        of its buffer there).
    """

    name: ClassVar[str] = "ngram-cache"
    description: ClassVar[DrafterDescription] = DrafterDescription(
        summary="n-gram count caches of this slot's context, earlier generations (-lcd) and a corpus (-lcs)",
        options=(
            DrafterOption("lookup-cache-static", str, None, "static cache file (e.g. from `spekula ngram-cache build`)",
                          aliases=("-lcs",), llama_cpp=True, metavar="FILE"),
            DrafterOption("lookup-cache-dynamic", str, None, "dynamic cache file, read at start and rewritten after "
                          "requests", aliases=("-lcd",), llama_cpp=True, metavar="FILE"),
        ),
        builtin_order=4,
        slot_state="saved",  # the context counts outlive a request
    )
    draft_cap: ClassVar[int] = N_DRAFT

    def __init__(
        self,
        *,
        static: NgramCache | None = None,
        dynamic: NgramCache | None = None,
        dynamic_path: str | None = None,
        llama_compat_update: bool = False,
    ) -> None:
        self.static: NgramCache = static if static is not None else {}
        self.dynamic: NgramCache = dynamic if dynamic is not None else {}
        self.dynamic_path = dynamic_path or None
        self.llama_compat_update = llama_compat_update
        self._slots: SlotStates[_SlotCache] = SlotStates(lambda _slot: _SlotCache())

    @classmethod
    def create(cls, ctx: DrafterContext) -> NgramCacheDrafter:
        static_path, dynamic_path = (ctx.text_value(o) for o in cls.description.options)
        static = load_cache(static_path) if static_path else {}
        dynamic = load_cache(dynamic_path) if dynamic_path and Path(dynamic_path).exists() else {}
        if dynamic_path:
            try:
                check_writable(dynamic_path)
            except NgramCacheError as exc:
                raise ConfigError(f"-lcd/--lookup-cache-dynamic: {exc}") from None
        return cls(static=static, dynamic=dynamic, dynamic_path=dynamic_path or None)

    def _count(self, st: _SlotCache, new_tokens: Sequence[int]) -> None:
        start = len(st.seen)
        st.seen.extend(int(t) for t in new_tokens)
        since = start if self.llama_compat_update else 0
        update_cache(st.context, st.seen, start, context_from=since)
        if self.dynamic_path:
            update_cache(st.delta, st.seen, start, context_from=since)

    def _rewind(self, st: _SlotCache, tokens: np.ndarray) -> None:
        """Forget counted positions from the first one where `tokens` differs from what was seen."""
        k = min(len(st.seen), len(tokens))
        if k:
            diff = np.flatnonzero(np.asarray(st.seen[:k], dtype=np.int64) != tokens[:k].astype(np.int64))
            k = int(diff[0]) if diff.size else k
        del st.seen[k:]

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        st = self._slots.get(slot)
        if not self.llama_compat_update:
            self._rewind(st, prompt)
            if len(st.seen) < len(prompt):
                self._count(st, prompt[len(st.seen) :].tolist())

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft(self.draft_one(r.slot, r.history, r.last, r.n_max)) for r in requests]

    def draft_one(self, slot: int, hist: np.ndarray, last: int, n_max: int = N_DRAFT) -> list[int]:
        st = self._slots.get(slot)
        length = len(hist)
        if len(st.seen) > length + 1 and not self.llama_compat_update:
            # History got shorter without a begin (context shift): recount from the common prefix.
            self._rewind(st, np.append(hist, np.int32(last)))
        if len(st.seen) < length + 1:
            new = hist[len(st.seen) :].tolist() if len(st.seen) < length else []
            new.append(int(last))
            self._count(st, new)
        if n_max <= 0:
            return []
        tail = hist[max(length - NGRAM_MAX + 1, 0) :].tolist() + [int(last)]
        return cache_draft(tail, min(N_DRAFT, n_max), st.context, self.dynamic, self.static)

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None

    def save_slot(self, slot: int) -> dict[str, np.ndarray] | None:
        st = self._slots.peek(slot)
        if st is None:
            return None
        return {"seen": np.array(st.seen, np.int32), "context": _cache_rows(st.context), "delta": _cache_rows(st.delta)}

    def load_slot(self, slot: int, arrays: dict[str, np.ndarray] | None) -> None:
        if arrays is None:
            self._slots.pop(slot)
            return
        seen = state_array(arrays, "seen", np.int32, (None,)).tolist()
        context = _cache_from_rows(state_array(arrays, "context", np.int64, (None, NGRAM_MAX + 2)))
        delta = _cache_from_rows(state_array(arrays, "delta", np.int64, (None, NGRAM_MAX + 2)))
        self._slots.put(slot, _SlotCache(seen, context, delta))

    def end(self, slot: int) -> None:
        st = self._slots.peek(slot)
        if st is None or not self.dynamic_path or not st.delta:
            return
        merge_cache(self.dynamic, st.delta)
        st.delta = {}
        try:
            save_cache(self.dynamic, self.dynamic_path)
        except (OSError, SpekulaError) as exc:
            # The request's answer is complete; the counts stay in memory and the next save retries.
            log.warning("could not save the dynamic n-gram cache to %s: %s", self.dynamic_path, exc)
