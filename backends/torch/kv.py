"""Per-sequence KV caches written by position.

A sequence's keys and values live in one buffer per kind, ``[n_layer, n_head_kv, capacity, head_dim]``.
Writing at position ``p`` overwrites whatever was there, so ``truncate`` only moves the length
(O(1)); stale entries beyond the length are masked by attention and later overwritten.

Buffers start zeroed and are only ever written with finite values: attention multiplies masked
positions by an exact 0 probability, and 0 * finite adds nothing, while 0 * NaN would poison the row.
Capacity grows in whole key buckets so an attention window ``[:bucket_end]`` is always in range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from spekula.backends.context_shift import check_shift
from spekula.backends.seq_state import ExpectedArrays, check_state_arrays
from spekula.backends.torch.recurrent import RecurrentSeq
from spekula.core.backend import SeqState
from spekula.core.errors import ConfigError


@dataclass
class SeqCache:
    k: torch.Tensor  # [n_layer, n_kv, cap, hd]
    v: torch.Tensor
    length: int = 0
    rec: RecurrentSeq | None = None  # hybrid models: the recurrent blocks' state

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])


def shift_cache(cache: SeqCache, n_keep: int, n_discard: int, rotate: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    """A context shift of one sequence's cache (core/backend.py's `shift`): positions [n_keep, n_keep +
    n_discard) leave, later ones move down, their keys re-roped by ``rotate(keys, -n_discard)``."""
    check_shift(n_keep, n_discard, cache.length)
    if n_discard == 0:
        return
    src, end = n_keep + n_discard, cache.length
    with torch.inference_mode():  # clone: source and destination overlap
        cache.k[:, :, n_keep : end - n_discard] = rotate(cache.k[:, :, src:end].clone(), -n_discard)
        cache.v[:, :, n_keep : end - n_discard] = cache.v[:, :, src:end].clone()
    cache.length = end - n_discard


class KVPool:
    """Owns the caches of all live sequences of one model."""

    def __init__(
        self,
        *,
        n_layer: int,
        n_head_kv: int,
        head_dim: int,
        n_ctx: int,
        n_seq_max: int,
        granule: int,
        dtype: torch.dtype,
        device: torch.device,
        new_recurrent: Callable[[], RecurrentSeq] | None = None,
    ) -> None:
        """``n_layer``: the attention blocks (a hybrid model's recurrent blocks keep no KV);
        ``new_recurrent``: makes a new sequence's recurrent state (hybrid models)."""
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.new_recurrent = new_recurrent
        self.n_ctx, self.n_seq_max, self.granule = n_ctx, n_seq_max, granule
        self.dtype, self.device = dtype, device
        # Capacity may exceed n_ctx by less than one granule so the last bucket fits.
        self.max_capacity = -(-n_ctx // granule) * granule
        self._seqs: dict[int, SeqCache] = {}

    def _alloc(self, cap: int) -> torch.Tensor:
        shape = (self.n_layer, self.n_head_kv, cap, self.head_dim)
        with torch.inference_mode():  # written only by forwards, which run in inference mode
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def new_seq(self) -> int:
        if len(self._seqs) >= self.n_seq_max:
            raise ConfigError(f"too many live sequences (n_seq_max={self.n_seq_max})")
        seq_id = next(i for i in range(self.n_seq_max + 1) if i not in self._seqs)
        cap = min(self.max_capacity, 4 * self.granule)
        rec = self.new_recurrent() if self.new_recurrent is not None else None
        self._seqs[seq_id] = SeqCache(self._alloc(cap), self._alloc(cap), rec=rec)
        return seq_id

    def get(self, seq_id: int) -> SeqCache:
        cache = self._seqs.get(seq_id)
        if cache is None:
            raise ConfigError(f"unknown sequence id {seq_id}")
        return cache

    def free(self, seq_id: int) -> None:
        self.get(seq_id)
        del self._seqs[seq_id]

    def truncate(self, seq_id: int, n_keep: int) -> None:
        cache = self.get(seq_id)
        if n_keep < 0:
            raise ConfigError(f"truncate: n_keep must be >= 0, got {n_keep}")
        cache.length = min(cache.length, n_keep)

    def reserve_for(self, cache: SeqCache, n_positions: int) -> None:
        """Make room for positions [0, n_positions) rounded up to a whole granule (amortised doubling)."""
        need = -(-n_positions // self.granule) * self.granule
        if need > cache.capacity:
            cap = min(self.max_capacity, max(need, 2 * cache.capacity))
            for name in ("k", "v"):
                old = getattr(cache, name)
                new = self._alloc(cap)
                new[:, :, : old.shape[2]] = old
                setattr(cache, name, new)

    # ---- a sequence's state in and out (slot files; core/backend.py) ----------------------------

    def _host_dtype(self) -> np.dtype:
        """How the cache's elements travel as numpy: float32 as is, 16-bit floats as their bits."""
        return np.dtype(np.float32) if self.dtype == torch.float32 else np.dtype(np.uint16)

    def _to_numpy(self, t: torch.Tensor) -> np.ndarray:
        t = t.detach().to("cpu").contiguous()
        return t.numpy().copy() if t.dtype == torch.float32 else t.view(torch.int16).numpy().view(np.uint16).copy()

    def _from_numpy(self, a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return (t if a.dtype == np.float32 else t.view(torch.int16).view(dtype)).to(self.device)

    def expected_state(self, n: int, rec: RecurrentSeq | None) -> ExpectedArrays:
        kv = (self._host_dtype(), (self.n_layer, self.n_head_kv, n, self.head_dim))
        out: ExpectedArrays = {"k": kv, "v": kv}
        if rec is not None:
            out["ssm"] = (np.dtype(np.float32), tuple(rec.ssm.shape))
            out["conv"] = (np.dtype(np.float32), tuple(rec.conv.shape))
        return out

    def export_seq(self, seq_id: int) -> SeqState:
        cache = self.get(seq_id)
        n = cache.length
        arrays = {"k": self._to_numpy(cache.k[:, :, :n]), "v": self._to_numpy(cache.v[:, :, :n])}
        if cache.rec is not None:
            arrays["ssm"], arrays["conv"] = self._to_numpy(cache.rec.ssm), self._to_numpy(cache.rec.conv)
        return SeqState(n, arrays)

    def import_seq(self, seq_id: int, state: SeqState) -> None:
        cache = self.get(seq_id)
        n = int(state.length)
        if not 0 <= n <= self.n_ctx:
            raise ConfigError(f"a state of {n} positions does not fit a context of {self.n_ctx}")
        check_state_arrays(state, self.expected_state(n, cache.rec))
        with torch.inference_mode():
            self.reserve_for(cache, n)
            cache.k[:, :, :n] = self._from_numpy(state.arrays["k"], self.dtype)
            cache.v[:, :, :n] = self._from_numpy(state.arrays["v"], self.dtype)
            if cache.rec is not None:
                cache.rec.load(self._from_numpy(state.arrays["ssm"], torch.float32),
                               self._from_numpy(state.arrays["conv"], torch.float32))
        cache.length = n

    def clear(self) -> None:
        self._seqs.clear()
