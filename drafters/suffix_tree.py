"""ctypes binding of the depth-bounded suffix tree (drafters/csrc/suffix_tree.c, built with the package).

A `SuffixTree` holds sequences of token ids and counts, for every substring of at most `max_depth`
tokens, how often it occurs in them. `speculate` finds the continuation of a context that the
counts make most likely to be right. Sequences can be removed again, which is how callers keep
the tree within a node budget.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from spekula.core.errors import ConfigError
from spekula.core.extension import extension_path

_i32p = ctypes.POINTER(ctypes.c_int32)


def _library_path() -> Path:
    return extension_path(Path(__file__).resolve().parent, "_suffix_tree", "the suffix drafter's library is")


@cache
def _lib() -> ctypes.CDLL:
    so = ctypes.CDLL(str(_library_path()))
    so.st_new.restype = ctypes.c_void_p
    so.st_new.argtypes = [ctypes.c_int32]
    so.st_free.restype = None
    so.st_free.argtypes = [ctypes.c_void_p]
    so.st_nodes.restype = ctypes.c_int64
    so.st_nodes.argtypes = [ctypes.c_void_p]
    so.st_seq_new.restype = ctypes.c_int32
    so.st_seq_new.argtypes = [ctypes.c_void_p]
    so.st_seq_append.restype = ctypes.c_int
    so.st_seq_append.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64]
    so.st_seq_remove.restype = None
    so.st_seq_remove.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    so.st_seq_len.restype = ctypes.c_int64
    so.st_seq_len.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    so.st_count.restype = ctypes.c_int64
    so.st_count.argtypes = [ctypes.c_void_p, _i32p, ctypes.c_int32]
    so.st_speculate.restype = ctypes.c_int32
    # Buffers go in as plain addresses (arr.ctypes.data): building a typed pointer per argument cost
    # more than the search itself.
    so.st_speculate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_float,
                                ctypes.c_float, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_void_p]
    return so


@dataclass(frozen=True, slots=True)
class Speculation:
    tokens: list[int]
    probs: list[float]  # probability that the first i+1 tokens are all right, by the counts
    score: float  # expected number of right tokens: sum(probs)
    match_len: int  # how many context tokens the continuation was found after


NO_SPECULATION = Speculation([], [], 0.0, 0)


def _i32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int32)


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._lib = _lib()
        self._tree = self._lib.st_new(max_depth)
        if not self._tree:
            raise ConfigError(f"cannot create a suffix tree of depth {max_depth} (1..1024, or out of memory)")
        # speculate()'s output buffers, reused: its tokens, their probabilities, and (score, match length)
        # as a float32 and an int32 side by side.
        self._out = np.zeros(2, np.int32)
        self._buffers(32)

    def _buffers(self, n: int) -> None:
        self._tokens, self._probs = np.zeros(n, np.int32), np.zeros(n, np.float32)
        self._addr = (self._tokens.ctypes.data, self._probs.ctypes.data, self._out.ctypes.data)

    def close(self) -> None:
        if self._tree:
            self._lib.st_free(self._tree)
            self._tree = None

    def __del__(self) -> None:
        self.close()

    @property
    def n_nodes(self) -> int:
        return int(self._lib.st_nodes(self._tree))

    def new_sequence(self) -> int:
        handle = int(self._lib.st_seq_new(self._tree))
        if handle < 0:
            raise MemoryError("suffix tree: out of memory for a new sequence")
        return handle

    def append(self, handle: int, tokens: Sequence[int] | np.ndarray) -> None:
        arr = _i32(tokens)
        if arr.size and self._lib.st_seq_append(self._tree, handle, arr.ctypes.data, arr.size) != 0:
            raise MemoryError("suffix tree: out of memory while adding tokens")

    def remove(self, handle: int) -> None:
        self._lib.st_seq_remove(self._tree, handle)

    def length(self, handle: int) -> int:
        return int(self._lib.st_seq_len(self._tree, handle))

    def count(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Occurrences of `tokens` in the sequences (0 if longer than max_depth)."""
        arr = _i32(tokens)
        return int(self._lib.st_count(self._tree, arr.ctypes.data_as(_i32p), arr.size))

    def speculate(self, context: np.ndarray, max_spec: int, *, factor: float, min_prob: float, min_match: int = 1,
                  self_count: int = 0) -> Speculation:
        if max_spec <= 0 or len(context) == 0:
            return NO_SPECULATION
        ctx = _i32(context[-(self.max_depth - 1) :] if self.max_depth > 1 else context[:0])
        if len(self._tokens) < max_spec:
            self._buffers(max_spec)
        tokens, probs, out = self._tokens, self._probs, self._out
        addr = self._addr
        n = int(self._lib.st_speculate(self._tree, ctx.ctypes.data, ctx.size, max_spec, factor, min_prob, min_match,
                                       self_count, addr[0], addr[1], addr[2], addr[2] + 4))
        if n <= 0:
            return NO_SPECULATION
        return Speculation(tokens[:n].tolist(), probs[:n].tolist(), float(out[:1].view(np.float32)[0]),
                           int(out[1]))
