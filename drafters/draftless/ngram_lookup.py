"""The n-gram drafters' per-round lookups, in C (drafters/draftless/csrc/ngram_lookup.c, with its Python module
drafters/draftless/csrc/ngram_module.c).

ngram-simple's backward search, ngram-map's latest-occurrence search and ngram-mod's table walk
and indexing run once per slot per round, right after a forward, when the interpreter's own code
and data are out of the caches. On open-ended text, where the drafters mostly find nothing, the
call is the whole price of asking them: with numpy it was tens of microseconds, through ctypes
60-80 us in that cold state, as an extension module taking arrays by the buffer protocol about 10.
The functions take int32 token arrays; anything else (lists, other integer types, strided views)
is converted first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from spekula.core.extension import import_extension


@cache
def _ext() -> ModuleType:
    return import_extension("spekula.drafters.draftless", "_ngram_lookup", Path(__file__).resolve().parent,
                            "the n-gram drafters' library is")


def require() -> None:
    """Fail now, with a ConfigError saying how to build it, when the library is missing (drafters
    call this when they are created, not at their first draft)."""
    _ext()


def tokens32(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """`tokens` as a contiguous int32 array (no copy when it already is one)."""
    return np.ascontiguousarray(tokens, dtype=np.int32)


def _call(fn: Callable[..., Any], arrays: tuple[Any, ...], *rest: int) -> Any:
    """fn(*arrays, *rest); arrays the module refuses (not contiguous int32) are converted and the call
    made again. The first try is the common case: the engine's histories are int32 already."""
    try:
        return fn(*arrays, *rest)
    except TypeError:
        return fn(*(tokens32(a) for a in arrays), *rest)


def last_match(hist: np.ndarray, pattern: Sequence[int], lo: int, hi: int, need: int = 1) -> int:
    """The largest j in [lo, hi] with hist[j : j+len(pattern)] == pattern, or -1 if the pattern
    occurs there fewer than `need` times. hi + len(pattern) past the history is a ValueError."""
    return int(_call(_ext().last_match, (hist, pattern), lo, hi, max(need, 1)))


def simple_draft(hist: np.ndarray, last: int, size_n: int, size_m: int, min_hits: int) -> list[int]:
    """ngram-simple's draft after (hist, last): see NgramSimpleDrafter. Sizes outside [1, 1024] are
    a ValueError."""
    drafted: list[int] = _call(_ext().simple_draft, (hist,), int(last), size_n, size_m, min_hits)
    return drafted


def mod_add_range(entries: np.ndarray, hist: np.ndarray, lo: int, hi: int, n: int, empty: int) -> int:
    """entries[idx(hist[i:i+n])] = hist[i+n] for i in [lo, hi) in order; returns the entries filled
    that were `empty`. `entries` is int32 with a power-of-two length (written in place, so it is
    never converted)."""
    try:
        return int(_ext().mod_add_range(entries, hist, lo, hi, n, empty))
    except TypeError:
        return int(_ext().mod_add_range(entries, tokens32(hist), lo, hi, n, empty))


def mod_walk(entries: np.ndarray, window: np.ndarray, n_min: int, n_max: int, empty: int) -> list[int]:
    """Follow the table from the n-gram `window` for up to n_max tokens ([] if it stops before n_min)."""
    drafted: list[int] = _call(_ext().mod_walk, (entries, window), n_min, n_max, empty)
    return drafted


def mod_walk_after(entries: np.ndarray, hist: np.ndarray, last: int, n: int, n_min: int, n_max: int,
                   empty: int) -> list[int]:
    """mod_walk from the n-gram (last n - 1 tokens of hist, then `last`); hist needs n - 1 tokens."""
    drafted: list[int] = _call(_ext().mod_walk_after, (entries, hist), int(last), n, n_min, n_max, empty)
    return drafted
