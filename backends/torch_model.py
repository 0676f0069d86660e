"""The llama / qwen2 / qwen3 decoder in plain PyTorch, run one row tile at a time.

The backend (``torch.py``) cuts a forward pass into :class:`Tile` s and this module runs a tile through
every block. What makes the exact mode exact is decided by the planner; here the rule is only that
every operation on a tile is either row-wise (norms, rope, activations) or a GEMM whose shapes the
planner fixed, so a row meets the same kernels wherever it sits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .gguf_weights import ModelHParams, rope_inv_freq
from .torch_kv import SeqCache


@dataclass
class AttnGroup:
    """Rows ``[r0, r1)`` of a tile: one sequence, consecutive positions, one key window ``[0, n_keys)``."""

    cache: SeqCache
    r0: int
    r1: int
    n_keys: int
    q_rows: int  # rows the attention GEMMs run on (>= r1 - r0; padding repeats the last row)
    mask: torch.Tensor  # bool [q_rows, n_keys], True where a key is in the row's future


@dataclass
class KVWrite:
    cache: SeqCache
    r0: int
    r1: int
    pos0: int


@dataclass
class Tile:
    tokens: torch.Tensor  # int64 [M] (padded rows hold token 0)
    cos: torch.Tensor  # [M, n_rot/2] float32
    sin: torch.Tensor
    n_real: int
    writes: list[KVWrite] = field(default_factory=list)
    groups: list[AttnGroup] = field(default_factory=list)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(n_head + 2 n_kv) * hd, H]: one GEMM instead of three
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ffn_norm: torch.Tensor
    wgu: torch.Tensor  # [2F, H]: gate rows then up rows
    bgu: torch.Tensor | None
    wdown: torch.Tensor
    bdown: torch.Tensor | None


def _rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    return y * w if w is not None else y


class TorchModel:
    def __init__(
        self, hp: ModelHParams, weights: dict[str, np.ndarray], *, dtype: torch.dtype, device: torch.device, max_pos: int
    ) -> None:
        self.hp, self.dtype, self.device = hp, dtype, device

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(weights[name]).to(device=device, dtype=dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return t(name) if name in weights else None

        def cat(*names: str) -> torch.Tensor:
            # Fused rows: one GEMM instead of three (qkv) or two (gate/up) per block.
            parts = [weights[n] for n in names]
            return torch.from_numpy(np.concatenate(parts, axis=0)).to(device=device, dtype=dtype).contiguous()

        self.embd = t("token_embd.weight")
        self.lm_head = self.embd if hp.tied_output else t("output.weight")
        self.lm_bias = opt("output.bias")
        self.out_norm = t("output_norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(hp.n_layer):
            b = f"blk.{i}."
            bias = cat(b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias") if hp.has_qkv_bias else None
            self.layers.append(
                LayerWeights(
                    attn_norm=t(b + "attn_norm.weight"),
                    wqkv=cat(b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"),
                    bqkv=bias,
                    q_norm=opt(b + "attn_q_norm.weight"),
                    k_norm=opt(b + "attn_k_norm.weight"),
                    wo=t(b + "attn_output.weight"),
                    bo=opt(b + "attn_output.bias"),
                    ffn_norm=t(b + "ffn_norm.weight"),
                    wgu=cat(b + "ffn_gate.weight", b + "ffn_up.weight"),
                    bgu=self._gate_up_bias(weights, b),
                    wdown=t(b + "ffn_down.weight"),
                    bdown=opt(b + "ffn_down.bias"),
                )
            )
        # Angles in float64 then rounded once, so every position's cos/sin is a fixed table entry.
        inv = rope_inv_freq(hp, weights)
        ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
        self.rope_cos = torch.from_numpy(np.cos(ang).astype(np.float32)).to(device)
        self.rope_sin = torch.from_numpy(np.sin(ang).astype(np.float32)).to(device)

    def _gate_up_bias(self, weights: dict[str, np.ndarray], b: str) -> torch.Tensor | None:
        g, u = weights.get(b + "ffn_gate.bias"), weights.get(b + "ffn_up.bias")
        if g is None and u is None:
            return None
        n_ff = self.hp.n_ff
        parts = [g if g is not None else np.zeros(n_ff, np.float32), u if u is not None else np.zeros(n_ff, np.float32)]
        return torch.from_numpy(np.concatenate(parts)).to(device=self.device, dtype=self.dtype)

    # ---- per-tile math ---------------------------------------------------------------------------

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [M, heads, hd]. NORM pairs (2i, 2i+1); NEOX pairs (i, i + n_rot/2)."""
        hp = self.hp
        n_rot = hp.n_rot
        xf = x.float()
        rot, rest = xf[..., :n_rot], xf[..., n_rot:]
        c, s = cos[:, None, :], sin[:, None, :]
        if hp.rope_neox:
            a, b = rot[..., : n_rot // 2], rot[..., n_rot // 2 :]
            out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out.to(x.dtype)

    def _attention(self, tile: Tile, layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
        """q: [M, n_head, hd] (roped). Writes [rows, n_head*hd] into ``out``."""
        hp = self.hp
        n_kv, g, hd = hp.n_head_kv, hp.n_head // hp.n_head_kv, hp.head_dim
        for grp in tile.groups:
            n = grp.r1 - grp.r0
            qg = q[grp.r0 : grp.r1]
            if grp.q_rows > n:
                qg = torch.cat((qg, qg[-1:].expand(grp.q_rows - n, -1, -1)), dim=0)
            R = grp.q_rows
            # heads h = kv*g + j share kv head `kv`: fold (j, row) into the GEMM's M dimension.
            qh = qg.permute(1, 0, 2).reshape(n_kv, g * R, hd)
            keys = grp.cache.k[layer, :, : grp.n_keys]
            vals = grp.cache.v[layer, :, : grp.n_keys]
            scores = torch.matmul(qh, keys.transpose(1, 2)).view(n_kv, g, R, grp.n_keys)
            scores = scores.float() * hp.attn_scale
            scores.masked_fill_(grp.mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(vals.dtype).view(n_kv, g * R, grp.n_keys)
            o = torch.matmul(probs, vals).view(hp.n_head, R, hd)[:, :n]
            out[grp.r0 : grp.r1] = o.permute(1, 0, 2).reshape(n, hp.n_head * hd)

    def run_tile(self, tile: Tile, capture: frozenset[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run every block on one tile; returns (post-norm hidden [M, H], captured layer inputs)."""
        hp = self.hp
        nq, nkv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        x = F.embedding(tile.tokens, self.embd)
        M = x.shape[0]
        captured: dict[int, torch.Tensor] = {}
        attn_out = torch.zeros((M, nq), dtype=self.dtype, device=self.device)
        for li, lw in enumerate(self.layers):
            if li in capture:
                captured[li] = x[: tile.n_real].clone()
            h = _rms_norm(x, lw.attn_norm, hp.rms_eps)
            qkv = F.linear(h, lw.wqkv, lw.bqkv)
            q = qkv[:, :nq].view(M, hp.n_head, hp.head_dim)
            k = qkv[:, nq : nq + nkv].view(M, hp.n_head_kv, hp.head_dim)
            v = qkv[:, nq + nkv :].view(M, hp.n_head_kv, hp.head_dim)
            if lw.q_norm is not None and lw.k_norm is not None:
                q = _rms_norm(q, lw.q_norm, hp.rms_eps)
                k = _rms_norm(k, lw.k_norm, hp.rms_eps)
            q = self._rope(q, tile.cos, tile.sin)
            k = self._rope(k, tile.cos, tile.sin)
            for w in tile.writes:
                n = w.r1 - w.r0
                w.cache.k[li, :, w.pos0 : w.pos0 + n] = k[w.r0 : w.r1].transpose(0, 1)
                w.cache.v[li, :, w.pos0 : w.pos0 + n] = v[w.r0 : w.r1].transpose(0, 1)
            self._attention(tile, li, q, attn_out)
            x = x + F.linear(attn_out, lw.wo, lw.bo)
            h = _rms_norm(x, lw.ffn_norm, hp.rms_eps)
            gu = F.linear(h, lw.wgu, lw.bgu)
            x = x + F.linear(F.silu(gu[:, : hp.n_ff]) * gu[:, hp.n_ff :], lw.wdown, lw.bdown)
        if hp.n_layer in capture:
            captured[hp.n_layer] = x[: tile.n_real].clone()
        return _rms_norm(x, self.out_norm, hp.rms_eps), captured

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head, self.lm_bias)
