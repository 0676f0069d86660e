"""The sequence methods every backend and MTP runtime offers, written once over a pool of sequences.

A backend (or MTP runtime) keeps its sequences in a pool (``_seqs``): torch's and onnx's KV pools,
or a :class:`SlotPool` of a native context's KV slots. :class:`PooledSeqs` answers
``new_seq`` / ``free_seq`` / ``seq_len`` / ``truncate`` from that pool, so each backend only says
where its sequences live and how a slot's cache is reserved and released.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from spekula.core.errors import ConfigError


class SeqState(Protocol):
    length: int


class SeqPool(Protocol):
    def new_seq(self) -> int: ...

    def free(self, seq_id: int) -> None: ...

    def get(self, seq_id: int) -> SeqState: ...

    def truncate(self, seq_id: int, n_keep: int) -> None: ...


class PooledSeqs:
    """Mixin (listed before the Backend / MtpRuntime base): the sequence methods over ``self._seqs``."""

    _seqs: SeqPool

    def new_seq(self) -> int:
        return self._seqs.new_seq()

    def free_seq(self, seq_id: int) -> None:
        self._seqs.free(seq_id)

    def seq_len(self, seq_id: int) -> int:
        return self._seqs.get(seq_id).length

    def truncate(self, seq_id: int, n_keep: int) -> None:
        self._seqs.truncate(seq_id, n_keep)


@dataclass(slots=True)
class SlotSeq:
    slot: int  # the KV slot in [0, n_seq_max) the sequence's cache lives in
    length: int = 0


class SlotPool:
    """Sequence ids over the KV slots of native contexts: a new sequence takes the lowest free slot.

    ``reserve(slot)`` makes the slot's cache (raising to refuse the sequence) and ``release(slot)``
    frees it. Ids are never reused, so a stale id is an unknown sequence rather than someone else's.
    Truncating clamps ``n_keep`` into ``[0, length]``.
    """

    def __init__(self, n_seq_max: int, reserve: Callable[[int], None], release: Callable[[int], None],
                 what: str = "sequence") -> None:
        self.n_seq_max, self.what = n_seq_max, what
        self._reserve, self._release = reserve, release
        self._seqs: dict[int, SlotSeq] = {}
        self._next_id = 0

    def new_seq(self) -> int:
        used = {s.slot for s in self._seqs.values()}
        free = next((s for s in range(self.n_seq_max) if s not in used), None)
        if free is None:
            raise ConfigError(f"too many live {self.what}s (n_seq_max={self.n_seq_max})")
        self._reserve(free)
        seq_id = self._next_id
        self._next_id += 1
        self._seqs[seq_id] = SlotSeq(free)
        return seq_id

    def get(self, seq_id: int) -> SlotSeq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ConfigError(f"unknown {self.what} {seq_id}")
        return seq

    def free(self, seq_id: int) -> None:
        self._release(self.get(seq_id).slot)
        del self._seqs[seq_id]

    def truncate(self, seq_id: int, n_keep: int) -> None:
        seq = self.get(seq_id)
        seq.length = max(0, min(int(n_keep), seq.length))

    def clear(self) -> None:
        """Forget every sequence (their contexts are being freed)."""
        self._seqs.clear()
