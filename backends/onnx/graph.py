"""Build the ONNX graph of a GGUF decoder (as gguf/architecture.py describes it) from dequantized numpy weights.

The graph is written with ``onnx.helper`` so every op is visible here and no exporter tracing is
involved. It computes one forward over ``T`` new tokens for ``B`` sequences at once:

inputs
  input_ids     int64   [B, T]
  position_ids  int64   [B, T]
  attn_mask     float32 [B, 1, 1, T, P+T]   additive (0 or -inf): row t of sequence b may see key s
  logit_rows    int64   [N]                 flat indices into the B*T rows whose logits are wanted
  moe_rows      int64   [M, C]              MoE graphs only: flat rows the experts compute, C copies each
  past_k_<l>, past_v_<l>  float32 [B, P, n_head_kv, head_dim]   cached keys/values (positions 0..P-1)
outputs
  logits        float32 [N, n_vocab]
  new_k_<l>, new_v_<l>    float32 [B, T, n_head_kv, head_dim]   keys/values of the new tokens (after RoPE)
  resid_<l>     float32 [B, T, n_embd]      residual entering block l (l = n_layer: after the last block)
  hidden_final  float32 [B, T, n_embd]      after output_norm

The cache layout [P, n_head_kv, head_dim] per sequence makes "positions 0..P-1" a contiguous prefix of
a preallocated buffer, so the backend can hand ORT the cache without copying and let ORT write the
new keys straight into the buffer at their positions (see backends/onnx/backend.py). The mask is an input so
that any cache length, padding and batch layout is the caller's business, not the graph's.

Standard ONNX ops only, plus MatMulNBits for the opt-in q4 weights (onnx/quant.py) and MoE for the
experts of MoE blocks (onnx/moe.py). ORT's GroupQueryAttention / RotaryEmbedding
contrib ops are not used: their CUDA kernels want a shared past/present buffer layout that could not
be checked here without a GPU, and on CPU ORT already fuses the RMSNorm pattern; GQA is done by
broadcasting K/V over each group in MatMul instead of repeating it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from spekula.backends.gguf.weights import rope_inv_freq
from spekula.backends.onnx.builder import MS_DOMAIN, MS_OPSET, GraphBuilder, LinearFn
from spekula.backends.onnx.moe import MOE_ROWS, moe_ffn

if TYPE_CHECKING:
    from spekula.backends.gguf.architecture import ModelHParams

OPSET = 18
IR_VERSION = 9  # understood by every onnxruntime >= 1.16


def resid_name(layer: int) -> str:
    """Internal name of the residual entering block `layer` (n_layer: after the last block)."""
    return f"resid_{layer}"


HIDDEN_FINAL = "hidden_final"


def _rms_norm(g: GraphBuilder, x: str, weight: str, eps: float) -> str:
    # Pow -> ReduceMean -> Add -> Sqrt -> Div -> Mul: the pattern ORT fuses into SimplifiedLayerNormalization.
    sq = g.op("Pow", [x, g.const(2.0, np.float32)])
    ms = g.op("ReduceMean", [sq, g.const([-1])], keepdims=1)
    std = g.op("Sqrt", [g.op("Add", [ms, g.const(eps, np.float32)])])
    return g.op("Mul", [g.op("Div", [x, std]), weight])


class _Rope:
    """cos/sin of every (row, pair) computed once per forward in float64 (times YaRN's magnitude, when the
    file has one, before rounding), then used by all layers."""

    def __init__(self, g: GraphBuilder, hp: ModelHParams, positions: str, inv_freq: np.ndarray) -> None:
        self.hp = hp
        pos = g.op("Unsqueeze", [g.op("Cast", [positions], to=TensorProto.DOUBLE), g.const([-1])])
        ang = g.op("Mul", [pos, g.init("rope_inv_freq", inv_freq.astype(np.float64))])  # [B, T, n_half]
        cos, sin = g.op("Cos", [ang]), g.op("Sin", [ang])
        if hp.rope_mscale != 1.0:
            ms = g.const(hp.rope_mscale, np.float64)
            cos, sin = g.op("Mul", [cos, ms]), g.op("Mul", [sin, ms])
        cos = g.op("Cast", [cos], to=TensorProto.FLOAT)
        sin = g.op("Cast", [sin], to=TensorProto.FLOAT)
        # Broadcast over heads: [B, T, 1, n_half]; NORM rope pairs need one more trailing axis.
        self.cos4 = g.op("Unsqueeze", [cos, g.const([2])])
        self.sin4 = g.op("Unsqueeze", [sin, g.const([2])])
        self.cos5 = g.op("Unsqueeze", [self.cos4, g.const([-1])])
        self.sin5 = g.op("Unsqueeze", [self.sin4, g.const([-1])])

    def apply(self, g: GraphBuilder, x: str) -> str:
        """x: [B, T, heads, head_dim]."""
        hp = self.hp
        rest = None
        if hp.n_rot < hp.head_dim:  # dims >= n_rot pass through unrotated
            x, rest = g.ops("Split", [x, g.const([hp.n_rot, hp.head_dim - hp.n_rot])], 2, axis=-1)
        if hp.rope_neox:  # rotate (x[i], x[i + n_rot/2])
            x0, x1 = g.ops("Split", [x], 2, axis=-1, num_outputs=2)
            c, s = self.cos4, self.sin4
        else:  # NORM / GPT-J: rotate (x[2i], x[2i+1])
            pairs = g.op("Reshape", [x, g.const([0, 0, 0, hp.n_rot // 2, 2])])
            x0, x1 = g.ops("Split", [pairs], 2, axis=-1, num_outputs=2)
            c, s = self.cos5, self.sin5
        o0 = g.op("Sub", [g.op("Mul", [x0, c]), g.op("Mul", [x1, s])])
        o1 = g.op("Add", [g.op("Mul", [x0, s]), g.op("Mul", [x1, c])])
        out = g.op("Concat", [o0, o1], axis=-1)
        if not hp.rope_neox:
            out = g.op("Reshape", [out, g.const([0, 0, 0, hp.n_rot])])
        if rest is not None:
            out = g.op("Concat", [out, rest], axis=-1)
        return out


def _query_temperature(g: GraphBuilder, hp: ModelHParams, positions: str) -> str | None:
    """[B, T, 1, 1]: each row's query multiplier ``1 + scale * ln(floor(p / floor_len) + 1)`` (float64, rounded
    once, as the other runtimes compute it), or None when the file has no attention temperature."""
    temp = hp.attn_temperature
    if temp is None:
        return None
    pos = g.op("Cast", [positions], to=TensorProto.DOUBLE)
    steps = g.op("Floor", [g.op("Div", [pos, g.const(float(temp.floor_len), np.float64)])])
    log = g.op("Log", [g.op("Add", [steps, g.const(1.0, np.float64)])])
    factor = g.op("Add", [g.op("Mul", [log, g.const(temp.scale, np.float64)]), g.const(1.0, np.float64)])
    return g.op("Unsqueeze", [g.op("Cast", [factor], to=TensorProto.FLOAT), g.const([2, 3])])


def _value_info(name: str, elem: int, shape: Sequence[str | int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def build_graph(hp: ModelHParams, weights: dict[str, np.ndarray], linear: LinearFn) -> BuiltGraph:
    """The decoder graph (inputs and outputs in the module docstring)."""
    g = GraphBuilder()
    f32 = TensorProto.FLOAT
    kv_shape = ["B", "P", hp.n_head_kv, hp.head_dim]
    new_kv_shape = ["B", "T", hp.n_head_kv, hp.head_dim]
    inputs = [
        _value_info("input_ids", TensorProto.INT64, ["B", "T"]),
        _value_info("position_ids", TensorProto.INT64, ["B", "T"]),
        _value_info("attn_mask", f32, ["B", 1, 1, "T", "S"]),
        _value_info("logit_rows", TensorProto.INT64, ["N"]),
    ]
    if hp.moe is not None:
        inputs.append(_value_info(MOE_ROWS, TensorProto.INT64, ["M", "C"]))
    outputs = [_value_info("logits", f32, ["N", hp.n_vocab])]
    for i in range(hp.n_layer):
        inputs += [_value_info(f"past_k_{i}", f32, kv_shape), _value_info(f"past_v_{i}", f32, kv_shape)]
        outputs += [_value_info(f"new_k_{i}", f32, new_kv_shape), _value_info(f"new_v_{i}", f32, new_kv_shape)]

    def w(name: str) -> str:
        return g.init(name, weights[name].astype(np.float32))

    def maybe_bias(x: str, name: str) -> str:
        return g.op("Add", [x, w(name)]) if name in weights else x

    emb = g.init("token_embd.weight", weights["token_embd.weight"].astype(np.float32))
    x = g.op("Gather", [emb, "input_ids"], axis=0)  # [B, T, H]
    rope = _Rope(g, hp, "position_ids", rope_inv_freq(hp, weights))
    q_temperature = _query_temperature(g, hp, "position_ids")
    n_group = hp.n_head // hp.n_head_kv
    scale = g.const(hp.attn_scale, np.float32)
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        g.rename_output(x, resid_name(i))
        h = _rms_norm(g, x, w(p + "attn_norm.weight"), hp.rms_eps)
        q = maybe_bias(linear(g, h, p + "attn_q.weight"), p + "attn_q.bias")
        k = maybe_bias(linear(g, h, p + "attn_k.weight"), p + "attn_k.bias")
        v = maybe_bias(linear(g, h, p + "attn_v.weight"), p + "attn_v.bias")
        q = g.op("Reshape", [q, g.const([0, 0, hp.n_head, hp.head_dim])])
        k = g.op("Reshape", [k, g.const([0, 0, hp.n_head_kv, hp.head_dim])])
        v = g.op("Reshape", [v, g.const([0, 0, hp.n_head_kv, hp.head_dim])])
        if hp.has_qk_norm:  # per-head RMSNorm before RoPE
            q = _rms_norm(g, q, w(p + "attn_q_norm.weight"), hp.rms_eps)
            k = _rms_norm(g, k, w(p + "attn_k_norm.weight"), hp.rms_eps)
        q = rope.apply(g, q)
        if q_temperature is not None:  # after rope, queries only (llama.cpp's mistral3 graph)
            q = g.op("Mul", [q, q_temperature])
        k = rope.apply(g, k)
        g.rename_output(k, f"new_k_{i}")
        g.rename_output(v, f"new_v_{i}")
        k_all = g.op("Concat", [f"past_k_{i}", k], axis=1)  # [B, S, kv, hd]
        v_all = g.op("Concat", [f"past_v_{i}", v], axis=1)
        # GQA without repeating K/V: query head h uses kv head h // n_group, so split the query heads
        # into [kv, group] and let MatMul broadcast K/V over the group axis.
        q5 = g.op("Reshape", [q, g.const([0, 0, hp.n_head_kv, n_group, hp.head_dim])])
        q5 = g.op("Transpose", [q5], perm=[0, 2, 3, 1, 4])  # [B, kv, g, T, hd]
        kt = g.op("Unsqueeze", [g.op("Transpose", [k_all], perm=[0, 2, 3, 1]), g.const([2])])  # [B, kv, 1, hd, S]
        vt = g.op("Unsqueeze", [g.op("Transpose", [v_all], perm=[0, 2, 1, 3]), g.const([2])])  # [B, kv, 1, S, hd]
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q5, kt]), scale]), "attn_mask"])
        probs = g.op("Softmax", [scores], axis=-1)
        att = g.op("Transpose", [g.op("MatMul", [probs, vt])], perm=[0, 3, 1, 2, 4])  # [B, T, kv, g, hd]
        att = g.op("Reshape", [att, g.const([0, 0, hp.n_head * hp.head_dim])])
        x = g.op("Add", [x, maybe_bias(linear(g, att, p + "attn_output.weight"), p + "attn_output.bias")])
        h = _rms_norm(g, x, w(p + hp.ffn_norm_name + ".weight"), hp.rms_eps)
        if hp.moe is not None and hp.moe.is_moe(i):
            x = g.op("Add", [x, moe_ffn(g, linear, weights, hp.moe, h, p, hp.n_embd)])
            continue
        gate = maybe_bias(linear(g, h, p + "ffn_gate.weight"), p + "ffn_gate.bias")
        up = maybe_bias(linear(g, h, p + "ffn_up.weight"), p + "ffn_up.bias")
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])  # SiLU(gate) * up
        x = g.op("Add", [x, maybe_bias(linear(g, act, p + "ffn_down.weight"), p + "ffn_down.bias")])
    g.rename_output(x, resid_name(hp.n_layer))

    h_final = _rms_norm(g, x, w("output_norm.weight"), hp.rms_eps)
    rows = g.op("Gather", [g.op("Reshape", [h_final, g.const([-1, hp.n_embd])]), "logit_rows"], axis=0)
    # Gemm with transB reads the [V, H] matrix as stored, so a tied output shares token_embd's copy.
    out_w = g.init("output.weight", weights["output.weight"].astype(np.float32)) if "output.weight" in weights else emb
    gemm_in = [rows, out_w] + ([w("output.bias")] if "output.bias" in weights else [])
    g.rename_output(g.op("Gemm", gemm_in, transB=1), "logits")

    g.rename_output(h_final, HIDDEN_FINAL)
    # Every capturable hidden state is an output; a run fetches only those a drafter asked for. Measured
    # on SmolLM2 (CPU): no visible cost next to the matmuls, and one session serves every capture set.
    for name in [resid_name(i) for i in range(hp.n_layer + 1)] + [HIDDEN_FINAL]:
        outputs.append(_value_info(name, f32, ["B", "T", hp.n_embd]))

    graph = helper.make_graph(g.nodes, f"spekula_{hp.arch}", inputs, outputs)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, MS_OPSET)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="spekula")
    model.ir_version = IR_VERSION
    return BuiltGraph(model, g.initializers)


@dataclass(slots=True)
class BuiltGraph:
    """A model without its initializers, plus the arrays that become them when written."""

    model: onnx.ModelProto
    arrays: dict[str, np.ndarray]

    def with_inline_weights(self) -> onnx.ModelProto:
        """The complete model in memory (tests on tiny models; protobuf caps this at 2 GB)."""
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        model.graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in self.arrays.items())
        return model

