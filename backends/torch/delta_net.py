"""The gated delta-net token mixer of a hybrid model's recurrent blocks (Qwen3.5), in plain PyTorch.

One block over a tile's rows: one fused projection ``[qkv | beta | alpha | z]`` (a single planned GEMM),
then per sequence and token, in position order, the recurrence: the depthwise causal conv1d over the
qkv channels (its state: the last ``conv_kernel - 1`` pre-conv rows), SiLU, the per-head L2 norm of q
and k (``x / sqrt(sum x^2 + eps)`` with the file's RMS eps, as llama.cpp computes it), q scaled by
``1/sqrt(head_k_dim)``, ``beta = sigmoid(b)``, ``g = softplus(alpha + dt_bias) * ssm_a`` and the gated
delta rule on the per-head state ``S [head_v_dim, head_k_dim]``:

    S = exp(g) S;  S += outer((v - S k) * beta, k);  o = S q

Then the per-head RMS norm (``ssm_norm``) times ``silu(z)`` and ``ssm_out`` over the tile.

Why token by token: a sequence's state and outputs must not depend on how its rows were chunked or
batched (the exact mode's rule), so the recurrence is never evaluated in the chunked parallel form;
every operation of one token has the same shapes wherever the token sits. :func:`advance` is also what
a rollback replays (backends/torch/recurrent.py), so a replayed state is the forward's, bit for bit.

V heads: llama.cpp's converter stores the value heads tiled over the key heads (value head ``h`` reads
key head ``h % n_k_heads``; transformers' checkpoint groups them, ``h // (n_v / n_k)``), so q and k
are repeated whole, not interleaved. The recurrence runs in float32 whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from spekula.backends.gguf.architecture import DeltaNetParams
from spekula.backends.torch.linear import Lin
from spekula.backends.torch.moe import MakeLin, ToTensor


def delta_net_gemm_shapes(dn: DeltaNetParams, n_embd: int) -> list[tuple[int, int]]:
    """[n, k] of the block's two linears: the fused input projection and ssm_out."""
    return [(dn.conv_dim + 2 * dn.n_v_heads + dn.value_dim, n_embd), (n_embd, dn.value_dim)]


def recurrence_width(dn: DeltaNetParams) -> int:
    """Floats of one row's recurrence inputs: the pre-conv qkv channels, beta's and alpha's logits."""
    return dn.conv_dim + 2 * dn.n_v_heads


@dataclass
class DeltaNetWeights:
    """One recurrent block's tensors (on the model's device). Recurrence tensors are float32."""

    in_proj: Lin  # rows [qkv (conv_dim) | beta (n_v) | alpha (n_v) | z (value_dim)]
    conv: torch.Tensor  # [conv_kernel, conv_dim] float32: tap t multiplies the row t - (K-1) positions back
    dt_bias: torch.Tensor  # [n_v] float32
    ssm_a: torch.Tensor  # [n_v] float32, -exp(A_log)
    norm: torch.Tensor  # [head_v_dim] float32
    out: Lin  # ssm_out [n_embd, value_dim]


def build_delta_net(
    weights: dict[str, np.ndarray], prefix: str, *, device: torch.device, to_tensor: ToTensor, make_lin: MakeLin,
) -> DeltaNetWeights:
    """The weights of the block whose tensors start with ``prefix``; ``to_tensor`` moves an array to the
    model's device and dtype, ``make_lin`` builds a planned Lin (see TorchModel)."""
    fused = np.concatenate([weights[prefix + n] for n in ("attn_qkv.weight", "ssm_beta.weight", "ssm_alpha.weight",
                                                         "attn_gate.weight")], axis=0)

    def f32(name: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(weights[prefix + name])).to(device=device, dtype=torch.float32)

    return DeltaNetWeights(
        in_proj=make_lin(to_tensor(fused), None),
        conv=f32("ssm_conv1d.weight").t().contiguous(),
        dt_bias=f32("ssm_dt.bias"),
        ssm_a=f32("ssm_a"),
        norm=f32("ssm_norm.weight"),
        out=make_lin(to_tensor(weights[prefix + "ssm_out.weight"]), None),
    )


def advance(
    dn: DeltaNetParams, lw: DeltaNetWeights, eps: float, ssm: torch.Tensor, conv: torch.Tensor,
    rows: torch.Tensor, out: torch.Tensor | None,
) -> None:
    """Run the recurrence over ``rows`` [n, recurrence_width] (float32), one token at a time, updating the
    block's state in place: ``ssm`` [n_v, head_v_dim, head_k_dim] and ``conv`` [conv_kernel - 1, conv_dim].
    ``out`` [n, n_v, head_v_dim] receives each token's output when given (a replay passes None)."""
    C, Hv, nk, dk = dn.conv_dim, dn.n_v_heads, dn.n_k_heads, dn.head_k_dim
    kd = dn.key_dim
    rep = Hv // nk
    scale = 1.0 / float(dk) ** 0.5
    for t in range(rows.shape[0]):
        row = rows[t]
        window = torch.cat((conv, row[None, :C]))  # [K, C]: the K-1 previous rows, then this one
        conv.copy_(window[1:])
        mixed = F.silu((window * lw.conv).sum(0))
        q = mixed[:kd].view(nk, dk)
        k = mixed[kd : 2 * kd].view(nk, dk)
        v = mixed[2 * kd :].view(Hv, dn.head_v_dim)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) * scale
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
        if rep > 1:  # tiled: value head h reads key head h % n_k
            q, k = q.repeat(rep, 1), k.repeat(rep, 1)
        beta = torch.sigmoid(row[C : C + Hv])
        g = F.softplus(row[C + Hv : C + 2 * Hv] + lw.dt_bias) * lw.ssm_a
        ssm.mul_(torch.exp(g)[:, None, None])
        kv_mem = (ssm * k[:, None, :]).sum(-1)  # [Hv, dv]
        delta = (v - kv_mem) * beta[:, None]
        ssm.add_(delta[:, :, None] * k[:, None, :])
        if out is not None:
            out[t] = (ssm * q[:, None, :]).sum(-1)


def gated_output(dn: DeltaNetParams, lw: DeltaNetWeights, eps: float, o: torch.Tensor, proj: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """ssm_out(rms_norm(o) * ssm_norm * silu(z)) over a tile: o [M, n_v, head_v_dim] float32, z the last
    value_dim columns of the fused projection ``proj`` [M, *]. Every operation is row-wise."""
    M = o.shape[0]
    z = proj[:, recurrence_width(dn) :].view(M, dn.n_v_heads, dn.head_v_dim)
    y = torch.rms_norm(o, (dn.head_v_dim,), lw.norm, eps) * F.silu(z.float())
    return lw.out(y.view(M, dn.value_dim).to(dtype))
