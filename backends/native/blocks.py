"""The model description (gguf/architecture.py) as the native kernels' C structures.

The kernels run one block shape: RMSNorm before attention and FFN, optional per-head q/k norm (a
layer's q_norm / k_norm pointers, NULL when absent), optional q/k/v biases (each matrix's bias), rope
pairing as ``rope_neox``, an optional attention output gate (Qwen3.5: ``attn_q`` yields [q | gate] per
head), optional attention sinks (gpt-oss: a logit per head in every softmax), and a SwiGLU FFN that is
dense or a MoE block (native/moe.py). In hybrid models a gated
delta-net block (native/deltanet.py) takes attention's place. Gemma-style blocks add RMS norms of the
attention and FFN outputs (``attn_post_norm``, ``ffn_post_norm``), a GELU-gated FFN and scaled
embeddings; sliding blocks attend through the window with their own rope table (csrc/sk_swa.h). Gemma 4's
blocks (gguf/block_layout.py, csrc/sk_gemma4.h) may have their own head size, attend another block's keys
and values, norm their values, add a per-layer input and scale their output. Anything else a recipe can
name is refused when the description is read, so only this module maps it to C.
"""

from __future__ import annotations

from typing import Any

from spekula.backends.gguf.architecture import ModelHParams
from spekula.backends.native import lib as nl
from spekula.backends.native.deltanet import delta_net_block
from spekula.backends.native.moe import moe_block
from spekula.backends.native.weights import NativeWeights


def build_layer(w: NativeWeights, i: int) -> nl.Layer:
    """Block ``blk.i`` (trunk or MTP block) of the model ``w.hp`` describes."""
    hp, b = w.hp, f"blk.{i}."
    assert hp is not None, "a decoder block needs the model's description"
    layer = nl.Layer()
    layer.attn_norm = nl.ptr(w.vector(b + "attn_norm.weight"))
    layer.ffn_norm = nl.ptr(w.vector(b + hp.ffn_norm_name + ".weight"))
    if hp.delta_net is not None and hp.is_recurrent(i):
        layer.dn = delta_net_block(w, i, hp.delta_net)
        return _ffn(w, i, layer)
    if hp.post_norms:
        layer.attn_post_norm = nl.ptr(w.vector(b + "post_attention_norm.weight"))
        layer.ffn_post_norm = nl.ptr(w.vector(b + "post_ffw_norm.weight"))
    layer.sliding = int(hp.is_sliding(i))
    owns_kv = hp.layout.owns_kv(i)
    if hp.has_qk_norm:
        layer.q_norm = nl.ptr(w.vector(b + "attn_q_norm.weight"))
        if owns_kv:
            layer.k_norm = nl.ptr(w.vector(b + "attn_k_norm.weight"))
    if i < hp.n_layer:
        _block_layout(w, i, layer)
    def qkv(name: str, shape: tuple[int, ...] | None = None) -> nl.Tensor:
        # q/k/v biases are read when the description says the blocks have them, and then required
        bias = b + name + ".bias" if hp.has_qkv_bias else None
        return w.matrix(b + name + ".weight", bias, shape, bias_required=True)

    gate = hp.recipe.attn_output_gate  # q rows: [q | gate] per head
    q_rows = hp.n_head * (layer.head_dim or hp.head_dim) * (2 if gate else 1)
    layer.attn_gate = int(gate)
    if not owns_kv:  # queries only: the keys and values are another block's
        layer.wq = qkv("attn_q", (q_rows, hp.n_embd))
    elif w.f.has_tensor(b + "attn_qkv.weight") and not w.f.has_tensor(b + "attn_q.weight"):
        layer.wq = qkv("attn_qkv", (q_rows + 2 * hp.n_head_kv * hp.head_dim, hp.n_embd))
    else:
        # no attn_v (Gemma 4's attention_k_eq_v): the values are the key projection's output, so the value
        # rows are that same matrix, multiplied again by the same kernel: bitwise the raw keys
        v_name = "attn_k" if i in hp.layout.values_from_keys else "attn_v"
        layer.wq, layer.wk, layer.wv = qkv("attn_q", (q_rows, hp.n_embd)), qkv("attn_k"), qkv(v_name)
    layer.wo = w.matrix(b + "attn_output.weight", b + "attn_output.bias")
    if hp.recipe.attn_sinks:
        layer.attn_sinks = nl.ptr(w.vector(b + "attn_sinks.weight"))
    return _ffn(w, i, layer)


def _block_layout(w: NativeWeights, i: int, layer: nl.Layer) -> None:
    """Trunk block i's Gemma 4 fields (gguf/block_layout.py): head size, KV heads, shared KV, value norm, output
    scale, per-layer input (all left at "none" for other architectures)."""
    hp, b = w.hp, f"blk.{i}."
    assert hp is not None
    lay = hp.layout
    layer.head_dim = hp.block_head_dim(i)
    layer.kv_shared = 0 if lay.owns_kv(i) else lay.kv_of(i) + 1
    layer.n_head_kv = hp.block_n_head_kv(i) if lay.n_head_kv_blocks else 0
    layer.value_norm = int(hp.recipe.value_norm)
    if lay.out_scale:
        layer.out_scale = float(w.vector(b + "layer_output_scale.weight")[0])
    if lay.n_embd_per_layer:
        layer.ple_gate = w.matrix(b + "inp_gate.weight")
        layer.ple_proj = w.matrix(b + "proj.weight")
        layer.ple_norm = nl.ptr(w.vector(b + "post_norm.weight"))


def per_layer_input_fields(w: NativeWeights) -> dict[str, Any]:
    """The config fields of Gemma 4's per-layer inputs (none when the file has none)."""
    hp = w.hp
    assert hp is not None
    P = hp.layout.n_embd_per_layer
    if not P:
        return {}
    return {"n_embd_per_layer": P, "ple_embd": w.matrix("per_layer_token_embd.weight"),
            "ple_model_proj": w.matrix("per_layer_model_proj.weight"),
            "ple_proj_norm": nl.ptr(w.vector("per_layer_proj_norm.weight"))}


def _ffn(w: NativeWeights, i: int, layer: nl.Layer) -> nl.Layer:
    """blk.i's FFN into `layer`: the dense one or a MoE block."""
    hp, b = w.hp, f"blk.{i}."
    assert hp is not None
    if hp.moe is not None and hp.moe.is_moe(i):
        layer.moe = moe_block(w, i)
        if not hp.moe.beside_dense:
            return layer
        layer.moe_pre_norm = nl.ptr(w.vector(b + "pre_ffw_norm_2.weight"))  # Gemma 4: the dense FFN beside them
        layer.router_scale = nl.ptr(w.vector(b + "ffn_gate_inp.scale"))
        layer.dense_post_norm = nl.ptr(w.vector(b + "post_ffw_norm_1.weight"))
        layer.moe_post_norm = nl.ptr(w.vector(b + "post_ffw_norm_2.weight"))
    layer.w_gate = w.matrix(b + "ffn_gate.weight", b + "ffn_gate.bias")
    layer.w_up = w.matrix(b + "ffn_up.weight", b + "ffn_up.bias")
    layer.w_down = w.matrix(b + "ffn_down.weight", b + "ffn_down.bias")
    return layer


def model_config(hp: ModelHParams, **fields: Any) -> nl.Config:
    """A context's config: what the description decides (sizes, rope pairing, norm epsilon, attention
    scale, window, FFN gate, embedding scale, YaRN's magnitude and the queries' temperature) plus `fields`,
    the runtime's own (n_layer, n_ff, n_ctx, threads, tensors, the sliding blocks' rope table and row cap, ...)."""
    temp = hp.attn_temperature
    return nl.Config(n_vocab=hp.n_vocab, n_embd=hp.n_embd, n_head=hp.n_head, n_head_kv=hp.n_head_kv,
                     head_dim=hp.head_dim, n_rot=hp.n_rot, rope_neox=int(hp.rope_neox), rms_eps=hp.rms_eps,
                     attn_scale=hp.attn_scale, swa_window=hp.sliding_window if any(hp.swa_layers) else 0,
                     ffn_geglu=int(hp.geglu), embd_scale=0.0 if hp.embd_scale == 1.0 else hp.embd_scale,
                     rope_mscale=hp.rope_mscale, attn_temp_scale=temp.scale if temp is not None else 0.0,
                     attn_temp_floor=temp.floor_len if temp is not None else 0,
                     n_rot_swa=hp.n_rot_swa if hp.n_rot_swa != hp.n_rot else 0, **fields)
