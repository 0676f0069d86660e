"""The native backend's description of a gated delta-net block: see backends/native/csrc/sk_deltanet.h.

The projections point into the mapped file like every matmul weight; the conv kernel is copied once,
transposed to [conv_kernel][conv_dim] so the C side reads each tap's weights contiguously.
"""

from __future__ import annotations

import numpy as np

from spekula.backends.gguf.architecture import DeltaNetParams
from spekula.backends.gguf.weights import dequantize
from spekula.backends.native import lib as nl
from spekula.backends.native.weights import NativeWeights


def _floats(w: NativeWeights, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A small float32 tensor of a known shape, as its own array (kept alive by `w`)."""
    arr = np.ascontiguousarray(dequantize(w.entry(name, shape), w.f.path), dtype=np.float32)
    w.keep.append(arr)
    return arr


def delta_net_block(w: NativeWeights, i: int, dn: DeltaNetParams) -> nl.DeltaNet:
    """blk.i's projections (attn_qkv, attn_gate = z, ssm_beta, ssm_alpha, ssm_out), conv kernel and gates."""
    b, E = f"blk.{i}.", w.f.tensor("token_embd.weight").shape[1]
    conv = _floats(w, b + "ssm_conv1d.weight", (dn.conv_dim, dn.conv_kernel))
    conv_t = np.ascontiguousarray(conv.T)
    w.keep.append(conv_t)
    return nl.DeltaNet(
        n_k_heads=dn.n_k_heads, n_v_heads=dn.n_v_heads, head_k_dim=dn.head_k_dim, head_v_dim=dn.head_v_dim,
        conv_kernel=dn.conv_kernel,
        qkv=w.matrix(b + "attn_qkv.weight", shape=(dn.conv_dim, E)),
        z=w.matrix(b + "attn_gate.weight", shape=(dn.value_dim, E)),
        beta=w.matrix(b + "ssm_beta.weight", shape=(dn.n_v_heads, E)),
        alpha=w.matrix(b + "ssm_alpha.weight", shape=(dn.n_v_heads, E)),
        out=w.matrix(b + "ssm_out.weight", shape=(E, dn.value_dim)),
        conv_w=nl.ptr(conv_t), dt_bias=nl.ptr(_floats(w, b + "ssm_dt.bias", (dn.n_v_heads,))),
        a=nl.ptr(_floats(w, b + "ssm_a", (dn.n_v_heads,))),
        norm=nl.ptr(_floats(w, b + "ssm_norm.weight", (dn.head_v_dim,))))
