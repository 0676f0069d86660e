"""ctypes binding of the n-gram drafters' per-round lookups (drafters/csrc/ngram_lookup.c).

ngram-simple's backward search, ngram-map's latest-occurrence search and ngram-mod's table walk
and indexing run once per slot per round. Written with numpy they cost tens of microseconds per
call however short the history, which on text without repeats is the whole price of asking the
drafter; in C a call costs a microsecond or two. Arrays are passed by address: every function
here takes int32 token arrays and makes them contiguous int32 first.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np

from spekula.core.extension import extension_path

_vp, _i32, _i64, _u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64


@cache
def _lib() -> ctypes.CDLL:
    so = ctypes.CDLL(str(extension_path(Path(__file__).resolve().parent, "_ngram_lookup",
                                        "the n-gram drafters' library is")))
    so.ng_last_match.restype = _i64
    so.ng_last_match.argtypes = [_vp, _vp, _i32, _i64, _i64, _i32]
    so.ng_simple_draft.restype = _i32
    so.ng_simple_draft.argtypes = [_vp, _i64, _i32, _i32, _i32, _i32, _vp]
    so.ngm_add_range.restype = _i64
    so.ngm_add_range.argtypes = [_vp, _u64, _vp, _i64, _i64, _i32, _i32]
    so.ngm_walk.restype = _i32
    so.ngm_walk.argtypes = [_vp, _u64, _vp, _i32, _i32, _i32, _i32, _vp]
    return so


def require() -> None:
    """Fail now, with a ConfigError saying how to build it, when the library is missing (drafters
    call this when they are created, not at their first draft)."""
    _lib()


def tokens32(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """`tokens` as a contiguous int32 array (no copy when it already is one)."""
    return np.ascontiguousarray(tokens, dtype=np.int32)


def last_match(hist: np.ndarray, pattern: Sequence[int], lo: int, hi: int, need: int = 1) -> int:
    """The largest j in [lo, hi] with hist[j : j+len(pattern)] == pattern, or -1 if the pattern
    occurs there fewer than `need` times. The caller guarantees hi + len(pattern) <= len(hist)."""
    h, p = tokens32(hist), tokens32(pattern)
    if hi + len(p) > len(h):
        raise ValueError("search range runs past the history")
    return int(_lib().ng_last_match(h.ctypes.data, p.ctypes.data, len(p), lo, hi, max(need, 1)))


def simple_draft(hist: np.ndarray, last: int, size_n: int, size_m: int, min_hits: int) -> list[int]:
    """ngram-simple's draft after (hist, last): see NgramSimpleDrafter."""
    if size_n > 1024 or size_n < 1 or size_m < 1:
        raise ValueError("ngram-simple sizes must be in [1, 1024]")
    h = tokens32(hist)
    out = np.empty(size_m, dtype=np.int32)
    k = _lib().ng_simple_draft(h.ctypes.data, len(h), int(last), size_n, size_m, min_hits, out.ctypes.data)
    return out[:k].tolist()


def mod_add_range(entries: np.ndarray, hist: np.ndarray, lo: int, hi: int, n: int, empty: int) -> int:
    """entries[idx(hist[i:i+n])] = hist[i+n] for i in [lo, hi) in order; returns the entries filled
    that were `empty`. `entries` is int32 with a power-of-two length."""
    h = tokens32(hist)
    if lo < 0 or hi + n > len(h):
        raise ValueError("window range runs past the history")
    return int(_lib().ngm_add_range(_table(entries), len(entries) - 1, h.ctypes.data, lo, hi, n, empty))


def mod_walk(entries: np.ndarray, window: np.ndarray, n_min: int, n_max: int, empty: int) -> list[int]:
    """Follow the table from the n-gram `window` for up to n_max tokens ([] if it stops before n_min)."""
    w = tokens32(window)
    out = np.empty(max(n_max, 0), dtype=np.int32)
    k = _lib().ngm_walk(_table(entries), len(entries) - 1, w.ctypes.data, len(w), n_min, n_max, empty,
                        out.ctypes.data)
    return out[:k].tolist()


def _table(entries: np.ndarray) -> int:
    if entries.dtype != np.int32 or not entries.flags.c_contiguous or len(entries) & (len(entries) - 1):
        raise ValueError("the n-gram table must be a contiguous int32 array of power-of-two length")
    return int(entries.ctypes.data)
