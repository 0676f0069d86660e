"""Per-sequence KV caches for the ONNX backend, addressed by raw pointer for ORT's IO binding.

One buffer per sequence, ``[n_layer, 2 (k, v), capacity, n_head_kv, head_dim]`` float32. Positions are
the slowest axis inside a (layer, k|v) block, so "positions 0..P-1" is a contiguous prefix: ORT reads
the past straight from the buffer and writes the new tokens' keys/values straight into it at their
positions (see OnnxBackend._bind). Nothing is ever copied per step and truncate only moves the length.

Host buffers (CPU provider) are numpy arrays that grow by doubling up to n_ctx (amortised O(1) per
token; a sequence that never gets long never costs n_ctx of memory). Device buffers (CUDA provider) are
OrtValues allocated at n_ctx once, because the Python API has no device-to-device copy to grow them.
Buffers start zeroed and only ever receive finite values, so masked positions contribute exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spekula.core.errors import ConfigError

_FLOAT_BYTES = 4
_HOST_MIN_CAPACITY = 256


@dataclass(slots=True)
class SeqKV:
    buffer: Any  # np.ndarray on the host, onnxruntime.OrtValue on a device
    capacity: int
    length: int = 0
    host: np.ndarray | None = field(default=None)  # the numpy view when on the host


class KVPool:
    """All live sequences' caches of one model."""

    def __init__(self, *, n_layer: int, n_head_kv: int, head_dim: int, n_ctx: int, n_seq_max: int,
                 device: str = "cpu", device_id: int = 0, slack: int = 0) -> None:
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.n_seq_max = n_seq_max
        # Storage may run `slack` positions past n_ctx: padding rows of the exact mode write there.
        self.n_ctx = n_ctx + slack
        self.device, self.device_id = device, device_id
        self.row_bytes = n_head_kv * head_dim * _FLOAT_BYTES
        self._seqs: dict[int, SeqKV] = {}
        self._spare: list[Any] = []  # freed device buffers, reused instead of reallocated

    def _shape(self, cap: int) -> tuple[int, ...]:
        return (self.n_layer, 2, cap, self.n_head_kv, self.head_dim)

    def _new_buffer(self, cap: int) -> SeqKV:
        if self.device == "cpu":
            arr = np.zeros(self._shape(cap), dtype=np.float32)
            return SeqKV(arr, cap, host=arr)
        if self._spare:
            return SeqKV(self._spare.pop(), self.n_ctx)
        import onnxruntime as ort

        zeros = np.zeros(self._shape(self.n_ctx), dtype=np.float32)
        value = ort.OrtValue.ortvalue_from_numpy(zeros, self.device, self.device_id)  # copies to the device
        return SeqKV(value, self.n_ctx)

    def new_seq(self) -> int:
        if len(self._seqs) >= self.n_seq_max:
            raise ConfigError(f"too many live sequences (n_seq_max={self.n_seq_max})")
        seq_id = next(i for i in range(self.n_seq_max + 1) if i not in self._seqs)
        self._seqs[seq_id] = self._new_buffer(min(self.n_ctx, _HOST_MIN_CAPACITY))
        return seq_id

    def get(self, seq_id: int) -> SeqKV:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ConfigError(f"unknown sequence id {seq_id}")
        return seq

    def free(self, seq_id: int) -> None:
        seq = self.get(seq_id)
        del self._seqs[seq_id]
        if seq.host is None:
            self._spare.append(seq.buffer)

    def clear(self) -> None:
        """Forget every sequence and spare buffer, releasing their memory."""
        self._seqs.clear()
        self._spare.clear()

    def truncate(self, seq_id: int, n_keep: int) -> None:
        seq = self.get(seq_id)
        if n_keep < 0:
            raise ConfigError(f"truncate: n_keep must be >= 0, got {n_keep}")
        seq.length = min(seq.length, n_keep)

    def reserve(self, seq_id: int, n_positions: int) -> SeqKV:
        """Make room for positions [0, n_positions); host buffers grow by doubling, keeping the prefix."""
        seq = self.get(seq_id)
        if n_positions > self.n_ctx:
            raise ConfigError(f"sequence {seq_id} would hold {n_positions} positions; the cache holds {self.n_ctx}")
        if n_positions > seq.capacity:
            assert seq.host is not None  # device buffers are allocated at n_ctx
            cap = seq.capacity
            while cap < n_positions:
                cap *= 2
            grown = np.zeros(self._shape(min(cap, self.n_ctx)), dtype=np.float32)
            grown[:, :, : seq.length] = seq.host[:, :, : seq.length]
            seq.buffer = seq.host = grown
            seq.capacity = grown.shape[2]
        return seq

    def base_ptr(self, seq: SeqKV) -> int:
        return int(seq.host.ctypes.data) if seq.host is not None else int(seq.buffer.data_ptr())

    def ptr(self, seq: SeqKV, layer: int, which: int, pos: int) -> int:
        """Address of (layer, k=0|v=1, position) in the sequence's buffer."""
        block = (layer * 2 + which) * seq.capacity + pos
        return self.base_ptr(seq) + block * self.row_bytes
