"""The depth-bounded suffix tree (drafters/draftless/csrc/suffix_tree.c, with its Python module
drafters/draftless/csrc/suffix_module.c, built with the package).

A `SuffixTree` holds sequences of token ids and counts, for every substring of at most `max_depth`
tokens, how often it occurs in them. `speculate` finds the continuation of a context that the
counts make most likely to be right. Sequences can be removed again, which is how callers keep
the tree within a node budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from spekula.core.errors import ConfigError
from spekula.core.extension import import_extension


@cache
def _ext() -> ModuleType:
    return import_extension("spekula.drafters.draftless", "_suffix_tree", Path(__file__).resolve().parent,
                            "the suffix drafter's library is")


@dataclass(frozen=True, slots=True)
class Speculation:
    tokens: list[int]
    probs: list[float]  # probability that the first i+1 tokens are all right, by the counts
    score: float  # expected number of right tokens: sum(probs)
    match_len: int  # how many context tokens the continuation was found after


NO_SPECULATION = Speculation([], [], 0.0, 0)


def _i32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int32)


def _speculation(found: tuple[list[int], list[float], float, int] | None) -> Speculation:
    return NO_SPECULATION if found is None else Speculation(*found)


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        try:
            self._tree: Any = _ext().Tree(max_depth)
        except (ValueError, MemoryError):
            raise ConfigError(f"cannot create a suffix tree of depth {max_depth} (1..1024, or out of memory)") from None

    def close(self) -> None:
        self._tree.close()

    @property
    def n_nodes(self) -> int:
        return int(self._tree.nodes())

    def new_sequence(self) -> int:
        return int(self._tree.seq_new())

    def append(self, handle: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Add tokens to a sequence (MemoryError when the tree cannot grow: the tokens before stay)."""
        try:
            self._tree.append(handle, tokens)
        except TypeError:
            self._tree.append(handle, _i32(tokens))

    def push(self, handle: int, token: int) -> None:
        self._tree.push(handle, int(token))

    def remove(self, handle: int) -> None:
        self._tree.remove(handle)

    def length(self, handle: int) -> int:
        return int(self._tree.length(handle))

    def count(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Occurrences of `tokens` in the sequences (0 if longer than max_depth)."""
        return int(self._tree.count(_i32(tokens)))

    def speculate(self, context: Sequence[int] | np.ndarray, max_spec: int, *, factor: float, min_prob: float,
                  min_match: int = 1, self_count: int = 0) -> Speculation:
        """The continuation of `context` (its last max_depth - 1 tokens count)."""
        try:
            found = self._tree.speculate(context, max_spec, factor, min_prob, min_match, self_count)
        except TypeError:
            found = self._tree.speculate(_i32(context), max_spec, factor, min_prob, min_match, self_count)
        return _speculation(found)

    def speculate_after(self, source: SuffixTree, handle: int, max_spec: int, *, factor: float, min_prob: float,
                        min_match: int = 1, self_count: int = 0) -> Speculation:
        """speculate() with the tail of sequence `handle` of `source` (this tree or another) as the
        context, without copying it out."""
        return _speculation(self._tree.speculate_after(source._tree, handle, max_spec, factor, min_prob, min_match,
                                                       self_count))
