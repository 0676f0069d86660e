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


def moe_block(w: NativeWeights, i: int) -> ctypes._Pointer[nl.MoE]:
    """blk.i's router, experts and shared expert (the layer's moe field)."""
    moe, b = w.hp.moe, f"blk.{i}."
    assert moe is not None and moe.is_moe(i)
    bias = w.vector(b + "exp_probs_b.bias") if moe.selection_bias else None

    def exps(kind: str) -> ctypes.Array[nl.Tensor]:
        return _experts(w, f"{b}ffn_{kind}_exps.weight", f"{b}ffn_{kind}_exps.bias" if moe.expert_bias else None)

    router_bias = b + "ffn_gate_inp.bias" if moe.expert_bias else None
    block = nl.MoE(n_expert=moe.n_expert, n_expert_used=moe.n_expert_used, gating=nl.GATING_IDS[moe.gating],
                   norm_weights=int(moe.norm_weights), weights_scale=moe.weights_scale,
                   selection_bias=nl.ptr(bias),
                   router=w.matrix(b + "ffn_gate_inp.weight", router_bias, bias_required=True),
                   gate=exps("gate"), up=exps("up"), down=exps("down"),
                   activation=nl.ACTIVATION_IDS[moe.activation])
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
