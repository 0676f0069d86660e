"""The native backend's description of a MoE block's FFN: see backends/native/csrc/sk_moe.h.

Each expert is an ``sk_tensor`` view of its slice of the 3-D expert tensor (expert e's [out, in]
matrix is contiguous in the file), so nothing is copied here; the C side reads the mapped file.
"""

from __future__ import annotations

import ctypes

from spekula.backends.native import lib as nl
from spekula.backends.native.weights import NativeWeights


def _experts(w: NativeWeights, name: str, bias: str | None) -> ctypes.Array[nl.Tensor]:
    """One Tensor per expert of a 3-D [n_expert, out, in] tensor, each pointing into the mapped data, with
    its row of the [n_expert, out] bias tensor `bias` when there is one."""
    e = w.typed_entry(name)
    data = w.keep_data(e)
    n_expert, n_out, n_in = e.shape
    b = w.vector(bias).reshape(n_expert, n_out) if bias else None  # type: ignore[union-attr]
    views = (nl.Tensor * n_expert)(*[nl.tensor(data[k], e.type_name, n_out, n_in, None if b is None else b[k])
                                     for k in range(n_expert)])
    w.structs.append(views)
    return views


def _fused_gate_up(w: NativeWeights, name: str) -> tuple[ctypes.Array[nl.Tensor], ctypes.Array[nl.Tensor]]:
    """Gate and up views of each expert's [2F, in] slice of a fused [n_expert, 2F, in] tensor (Gemma 4's
    converter writes ffn_gate_up_exps): its first F rows are the gate, the next F the up projection."""
    moe = w.hp.moe
    assert moe is not None
    F = moe.n_ff_exp
    e = w.typed_entry(name, (moe.n_expert, 2 * F, w.hp.n_embd))
    data = w.keep_data(e)
    n_expert, _, n_in = e.shape
    gate = (nl.Tensor * n_expert)(*[nl.tensor(data[k][:F], e.type_name, F, n_in) for k in range(n_expert)])
    up = (nl.Tensor * n_expert)(*[nl.tensor(data[k][F:], e.type_name, F, n_in) for k in range(n_expert)])
    w.structs += [gate, up]
    return gate, up


def moe_block(w: NativeWeights, i: int) -> ctypes._Pointer[nl.MoE]:
    """blk.i's router, experts and shared expert (the layer's moe field)."""
    moe, b = w.hp.moe, f"blk.{i}."
    assert moe is not None and moe.is_moe(i)
    bias = w.vector(b + "exp_probs_b.bias") if moe.selection_bias else None

    def exps(kind: str) -> ctypes.Array[nl.Tensor]:
        return _experts(w, f"{b}ffn_{kind}_exps.weight", f"{b}ffn_{kind}_exps.bias" if moe.expert_bias else None)

    router_bias = b + "ffn_gate_inp.bias" if moe.expert_bias else None
    fused = w.f.has_tensor(b + "ffn_gate_up_exps.weight") and not w.f.has_tensor(b + "ffn_gate_exps.weight")
    gate, up = _fused_gate_up(w, b + "ffn_gate_up_exps.weight") if fused else (exps("gate"), exps("up"))
    scale = w.vector(b + "ffn_down_exps.scale", required=False) if moe.beside_dense else None
    block = nl.MoE(n_expert=moe.n_expert, n_expert_used=moe.n_expert_used, gating=nl.GATING_IDS[moe.gating],
                   norm_weights=int(moe.norm_weights), weights_scale=moe.weights_scale,
                   selection_bias=nl.ptr(bias),
                   router=w.matrix(b + "ffn_gate_inp.weight", router_bias, bias_required=True),
                   gate=gate, up=up, down=exps("down"),
                   activation=nl.ACTIVATION_IDS[moe.activation], expert_scale=nl.ptr(scale))
    if moe.n_expert_shared:
        block.shared_gate = w.matrix(b + "ffn_gate_shexp.weight")
        block.shared_up = w.matrix(b + "ffn_up_shexp.weight")
        block.shared_down = w.matrix(b + "ffn_down_shexp.weight")
    if moe.n_expert_shared and moe.shared_gate:  # sigmoid(x . ffn_gate_inp_shexp) scales the shared expert
        name, E = b + "ffn_gate_inp_shexp.weight", w.hp.n_embd
        stored = w.f.tensor(name).shape if w.f.has_tensor(name) else (E,)  # a vector, or a matrix of one row
        e = w.typed_entry(name, stored if stored in ((E,), (1, E)) else (E,))
        block.shared_inp = nl.tensor(w.keep_data(e), e.type_name, 1, E)
    w.structs.append(block)
    return ctypes.pointer(block)
