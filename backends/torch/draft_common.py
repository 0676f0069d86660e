"""Pieces both draft-architecture runtimes (EAGLE-3, DFlash) share: weights, norms, rope, KV cache, attention.

Draft numerics need not be batch-invariant: a draft only proposes, and the target verifies every
token, so these runtimes batch freely (all rows of all sequences through each projection at once).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch

from spekula.backends.context_shift import check_shift
from spekula.backends.gguf.weights import dequantize
from spekula.core.backend import BackendOptions
from spekula.core.drafting.draft_models import read_draft_attention
from spekula.core.errors import ConfigError, ContextOverflowError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile


def device_dtype(options: BackendOptions) -> tuple[torch.device, torch.dtype]:
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"draft device {options.device!r} requested but CUDA is not available")
    names = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    if options.dtype == "auto":
        return device, (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if options.dtype not in names:
        raise ConfigError(f"unknown draft dtype {options.dtype!r}")
    return device, names[options.dtype]


def tensor_f32(f: GGUFFile, name: str) -> np.ndarray:
    """One tensor of ``f`` as float32 in PyTorch order (quantized types dequantized by gguf_weights)."""
    return dequantize(f.tensor(name), f.path)


class Weights:
    """Loads named tensors from one GGUF onto the runtime's device, checking shapes."""

    def __init__(self, f: GGUFFile, device: torch.device, dtype: torch.dtype) -> None:
        self.f, self.device, self.dtype = f, device, dtype

    def has(self, name: str) -> bool:
        return self.f.has_tensor(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None, *, f32: bool = False) -> torch.Tensor:
        arr = tensor_f32(self.f, name)
        if shape is not None and tuple(arr.shape) != shape:
            raise ModelFileError(self.f.path, f"tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # memory-mapped file data: torch wants a private copy
            arr = arr.copy()
        return torch.from_numpy(arr).to(self.device, torch.float32 if f32 else self.dtype)

    def opt(self, name: str, shape: tuple[int, ...] | None = None, *, f32: bool = False) -> torch.Tensor | None:
        return self.get(name, shape, f32=f32) if self.has(name) else None


def target_embeddings(target_path: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_embd, output head) of the target model file; a tied target returns the same tensor twice."""
    w = Weights(GGUFFile(target_path), device, dtype)
    embd = w.get("token_embd.weight")
    return embd, (w.get("output.weight") if w.has("output.weight") else embd)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rope_angles(positions: torch.Tensor, n_rot: int, base: float, freq_scale: float,
                freq_factors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, n_rot/2] for pair i at position p: p * freq_scale * base^(-2i/n_rot) / ff_i."""
    inv = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64, device=positions.device) / n_rot)
    if freq_factors is not None:
        inv = inv / freq_factors.to(torch.float64)
    ang = positions.to(torch.float64)[:, None] * freq_scale * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, neox: bool) -> torch.Tensor:
    """x [n, heads, hd]; NEOX pairs (i, i+n_rot/2), NORM pairs (2i, 2i+1); dims >= n_rot pass through."""
    n_rot = cos.shape[-1] * 2
    xr, rest = x[..., :n_rot].float(), x[..., n_rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        a, b = xr[..., : n_rot // 2], xr[..., n_rot // 2:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(
        torch.nn.functional.silu(torch.nn.functional.linear(x, gate)) * torch.nn.functional.linear(x, up), down
    )


class KVStore:
    """Per-sequence K/V for every layer, indexed by position; capacity grows by doubling up to n_ctx."""

    def __init__(self, n_layer: int, n_kv: int, head_dim: int, n_ctx: int, n_seq_max: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.shape = (n_layer, n_kv, head_dim)
        self.n_ctx, self.n_seq_max = n_ctx, n_seq_max
        self.device, self.dtype = device, dtype
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}

    def new_seq(self) -> int:
        if len(self._len) >= self.n_seq_max:
            raise ConfigError(f"draft runtime already holds {self.n_seq_max} sequences")
        seq = next(i for i in range(self.n_seq_max + 1) if i not in self._len)
        n_layer, n_kv, hd = self.shape
        self._k[seq] = torch.zeros(n_layer, 64, n_kv, hd, device=self.device, dtype=self.dtype)
        self._v[seq] = torch.zeros_like(self._k[seq])
        self._len[seq] = 0
        return seq

    def _check(self, seq: int) -> None:
        if seq not in self._len:
            raise ConfigError(f"unknown draft sequence {seq}")

    def free_seq(self, seq: int) -> None:
        self._check(seq)
        del self._k[seq], self._v[seq], self._len[seq]

    def seq_len(self, seq: int) -> int:
        self._check(seq)
        return self._len[seq]

    def truncate(self, seq: int, n_keep: int) -> None:
        self._check(seq)
        self._len[seq] = min(self._len[seq], max(0, n_keep))

    def shift(self, seq: int, n_keep: int, n_discard: int, rotate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A context shift: positions [n_keep, n_keep + n_discard) leave and later ones move down by
        n_discard, their keys ([rows, n_kv, hd] per layer) passed through ``rotate`` (the re-rope)."""
        self._check(seq)
        end = self._len[seq]
        check_shift(n_keep, n_discard, end)
        if n_discard == 0:
            return
        src = n_keep + n_discard
        k, v = self._k[seq], self._v[seq]
        for layer in range(self.shape[0]):  # clone: source and destination overlap
            k[layer, n_keep:end - n_discard] = rotate(k[layer, src:end].clone()).to(self.dtype)
            v[layer, n_keep:end - n_discard] = v[layer, src:end].clone()
        self._len[seq] = end - n_discard

    def write(self, seq: int, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows at positions start..; everything at or after ``start`` from earlier writes is dropped."""
        self._check(seq)
        if start > self._len[seq]:
            raise ConfigError(f"draft sequence {seq}: write at {start} leaves a gap after {self._len[seq]}")
        end = start + k.shape[0]
        if end > self.n_ctx:
            raise ContextOverflowError(f"draft sequence {seq}: position {end - 1} exceeds n_ctx {self.n_ctx}")
        cap = self._k[seq].shape[1]
        if end > cap:
            new_cap = min(self.n_ctx, max(end, 2 * cap))
            for store in (self._k, self._v):
                grown = torch.zeros(self.shape[0], new_cap, *self.shape[1:], device=self.device, dtype=self.dtype)
                grown[:, :cap] = store[seq]
                store[seq] = grown
        self._k[seq][layer, start:end] = k.to(self.dtype)
        self._v[seq][layer, start:end] = v.to(self.dtype)
        self._len[seq] = end

    def view(self, seq: int, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[seq][layer, :end], self._v[seq][layer, :end]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos0: int, *, causal: bool) -> torch.Tensor:
    """q [n, H, hd] at positions q_pos0.. over k/v [L, Hkv, hd] at 0..L-1 -> [n, H*hd] (GQA, 1/sqrt(hd))."""
    n, n_head, hd = q.shape
    group = n_head // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [H, L, hd]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
    scores = torch.matmul(q.transpose(0, 1).float(), kk.transpose(1, 2)) / math.sqrt(hd)  # [H, n, L]
    if causal:
        qpos = torch.arange(q_pos0, q_pos0 + n, device=q.device)[:, None]
        kpos = torch.arange(k.shape[0], device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vv)  # [H, n, hd]
    return out.transpose(0, 1).reshape(n, n_head * hd).to(q.dtype)


def scatter_vocab(z: torch.Tensor, d2t: torch.Tensor | None, n_vocab: int, fill: float) -> torch.Tensor:
    """Draft-vocab rows [n, Vd] -> target-vocab rows [n, V] (``fill`` outside the draft vocabulary)."""
    if d2t is None:
        return z
    out = torch.full((z.shape[0], n_vocab), fill, dtype=z.dtype, device=z.device)
    out[:, d2t] = z
    return out


class TorchDraftBase:
    """Attention hyperparameters, feature input, per-sequence attention and sequence bookkeeping of
    both torch draft runtimes (mixed in ahead of their DraftRuntime ABC, whose sequence methods it
    implements by delegating to the KV store)."""

    device: torch.device
    dtype: torch.dtype
    kv: KVStore
    fc: torch.Tensor
    rope_freqs: torch.Tensor | None
    rope_neox: ClassVar[bool]  # the head's rope pairing: NEOX halves (DFlash) or NORM pairs (EAGLE-3)

    def read_attention(self, f: GGUFFile, arch: str, n_embd: int) -> None:
        """Head counts, head size, rope and norm epsilon (core.draft_models.read_draft_attention)."""
        a = read_draft_attention(f, arch, n_embd)
        self.n_head, self.n_head_kv, self.head_dim, self.n_rot = a.n_head, a.n_head_kv, a.head_dim, a.n_rot
        self.rope_base, self.freq_scale, self.eps = a.rope_base, a.freq_scale, a.eps

    def share_cpu(self) -> None:
        """Run on one intra-op thread when another runtime's kernels (the native target's) use the cores:
        torch's idle worker threads spin-wait and would take time from them. torch's thread count is
        per process; with a torch target the target's own setting stands (this is not called)."""
        if self.device.type == "cpu":
            torch.set_num_threads(1)

    # --- sequences -------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.kv.n_ctx

    def new_seq(self) -> int:
        return self.kv.new_seq()

    def free_seq(self, seq_id: int) -> None:
        self.kv.free_seq(seq_id)

    def seq_len(self, seq_id: int) -> int:
        return self.kv.seq_len(seq_id)

    def truncate(self, seq_id: int, n_keep: int) -> None:
        self.kv.truncate(seq_id, n_keep)

    @torch.inference_mode()
    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Drop and move the layers' cache rows; moved keys are re-roped by -n_discard (one rotation for
        all rows, since rope angles add), as the target's own shift does."""
        cos, sin = self.rope(torch.full((1,), -n_discard, device=self.device))

        def rotate(k: torch.Tensor) -> torch.Tensor:
            n = k.shape[0]
            return apply_rope(k.float(), cos.expand(n, -1), sin.expand(n, -1), neox=self.rope_neox)

        self.kv.shift(seq_id, n_keep, n_discard, rotate)

    # --- graph pieces ----------------------------------------------------------------------------
    def features_in(self, features: np.ndarray, arch: str) -> torch.Tensor:
        """Captured target features [T, fc inputs] on the runtime's device and dtype."""
        x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)).to(self.device, self.dtype)
        if x.ndim != 2 or x.shape[1] != self.fc.shape[1]:
            raise ValueError(f"{arch} features must be [T, {self.fc.shape[1]}], got {tuple(x.shape)}")
        return x

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions, self.n_rot, self.rope_base, self.freq_scale, self.rope_freqs)

    def attend_spans(self, layer: int, spans: Sequence[tuple[int, int, int]], q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, *, causal: bool) -> torch.Tensor:
        """Rows of several sequences, concatenated: spans are (seq_id, start, n_rows) in row order.

        Each span's k/v are written at its positions first, so it attends to its own rows as well as
        its sequence's earlier entries. Returns [rows, n_head * head_dim].
        """
        attn = torch.empty(q.shape[0], self.n_head * self.head_dim, device=self.device, dtype=self.dtype)
        off = 0
        for seq_id, start, m in spans:
            self.kv.write(seq_id, layer, start, k[off:off + m], v[off:off + m])
            kc, vc = self.kv.view(seq_id, layer, start + m)
            attn[off:off + m] = attend(q[off:off + m], kc, vc, start, causal=causal)
            off += m
        return attn
