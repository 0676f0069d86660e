"""The mixture-of-experts FFN of MoE blocks in the ONNX graph.

Routing follows the description (backends/gguf/architecture.py) exactly and is computed with standard ops: the router's
softmax or sigmoid probabilities, ``TopK`` over probabilities + selection bias (ONNX's TopK puts the
lower index first on ties, as the routing rule wants), the chosen experts' unbiased probabilities as
weights, normalised with the sum clamped below at 2^-14, times the routed scale.

The experts run in onnxruntime's ``com.microsoft.MoE`` contrib op, which groups the rows by expert
and runs one GEMM pair per expert that has rows (onnxruntime has CPU and CUDA kernels for it; only
the CPU one has been run with these graphs: should the CUDA provider not take a node, ORT runs that
node on the CPU). Its own routing is fixed:
softmax over its ``router_probs`` input, top k, weights optionally renormalised over the top k. That
cannot express sigmoid gating, a selection bias or a routed scale, so the op is fed the routing
computed here in a form its softmax reproduces: ``log(weight)`` at the chosen experts, -1e30
elsewhere. Its top k are then exactly the chosen experts and its renormalised weights are
``weight_e / sum(weights)``; its output is multiplied back by ``sum(weights)`` per row. (QMoE's
``router_weights`` input separates selection from mixing, but QMoE takes only quantized experts and
the float32 graph keeps the GGUF's float weights.)

Why the contrib op, measured with bench/onnx_moe_paths.py (Qwen3-30B-A3B routing, 128 experts with 8
used, at half width: hidden 1024, expert FF 384; CPU, one thread, on a machine shared with other
jobs, so +-50 %), ms per forward, every path within 6e-6 of a float64 numpy reference:

  rows                 1      4      8     32    128
  contrib op           4     24     34     94     93
  contrib op, 4 copies 5     22     34     88    179
  gather              15     66    121    456    (4.5 GiB of weight copies)
  dense-over-experts  58    158    242    482   1020

"gather" (standard ops: Gather each row's k expert matrices, batched MatMul over [rows, k]) copies
k * 3 * n_ff_exp * n_embd floats per row, 150 MB per token and layer at Qwen3-30B-A3B's full width;
"dense" runs every expert on every row. The op reads each used expert's weights once per forward.

Which rows run through the experts, and how many copies of each, is the graph input ``moe_rows``
(int64 [n, copies], every entry of row i the flat index of one real row; other rows get no routed
output). Padding rows are left out: in a one-token decode step padded to 4 rows they would pull in
up to 3 * k further experts. Copies keep exact mode exact: the op's GEMM for an expert has as many
rows as that expert was given, which depends on what else is in the forward, and a row's result
changed in the last bits with that count (~1e-6 on the tiny fixtures' logits when a prompt is
chunked; here a GEMM of one row differs from one of more, backends/onnx/backend.py saw 1-3 rows differ from
4 on AVX2). Exact mode sends every row EXACT_ROW_MULTIPLE (4) times in a row, so each expert gets a
multiple of 4 rows made of whole copy groups, and chunked forwards agree bitwise again (2 copies
were already enough on this AVX-512 machine; 4 follows the dense rule). Copies choose the same
experts, so they add GEMM rows, not weight traffic: no visible cost up to 32 rows above, 2x at 128.

The op wants SwiGLU as one fused FC1 with gate and up rows interleaved (``swiglu_fusion=1``, the only
layout its CPU kernel accepts): row 2i is gate_i, row 2i+1 is up_i; with alpha 1, beta 0 and no limit
its activation is ``silu(gate) * up``. Expert tensors come [n_expert, out, in] (GGUF's PyTorch order),
the op's layout, so only gate and up are interleaved. Expert weights stay float32 with the q4 format
too (onnx/quant.py packs 2-D linear weights only); router and shared expert go through ``linear``.

The shared expert (GLM) is an ordinary SwiGLU FFN on every row, added to the routed output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from spekula.backends.gguf.moe import WEIGHT_SUM_MIN
from spekula.backends.onnx.builder import MS_DOMAIN, GraphBuilder, LinearFn

if TYPE_CHECKING:
    from spekula.backends.gguf.architecture import MoEParams

# Graph input (int64 [n, copies]): the flat rows the experts compute, each repeated `copies` times.
MOE_ROWS = "moe_rows"
# Router input of the experts not chosen: exp(-1e30 - max) is 0 in float32, so the op never picks them.
_NOT_CHOSEN = -1e30
# log() of a weight that underflowed to 0 would be -inf, below _NOT_CHOSEN: clamp to the smallest normal.
_WEIGHT_MIN = float(np.finfo(np.float32).tiny)


def moe_rows(real_rows: np.ndarray, copies: int) -> np.ndarray:
    """The ``moe_rows`` input for these flat row indices: [len(real_rows), copies] int64."""
    return np.repeat(np.asarray(real_rows, dtype=np.int64).reshape(-1, 1), copies, axis=1)


def swiglu_ffn(g: GraphBuilder, linear: LinearFn, x: str, prefix: str, suffix: str = "") -> str:
    """``down(silu(gate x) * up x)`` of the FFN ``<prefix>ffn_{gate,up,down}<suffix>``."""
    gate = linear(g, x, f"{prefix}ffn_gate{suffix}.weight")
    up = linear(g, x, f"{prefix}ffn_up{suffix}.weight")
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    return linear(g, act, f"{prefix}ffn_down{suffix}.weight")


def fused_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[E, F, H] gate and up -> [E, 2F, H] with gate_i in row 2i and up_i in row 2i+1 (swiglu_fusion=1)."""
    e, f, h = gate.shape
    return np.ascontiguousarray(np.stack([gate, up], axis=2).reshape(e, 2 * f, h), dtype=np.float32)


def route(g: GraphBuilder, linear: LinearFn, weights: dict[str, np.ndarray], moe: MoEParams, x: str,
          prefix: str) -> tuple[str, str]:
    """(chosen experts int64 [.., k], their mixing weights float [.., k]) for the rows of x."""
    logits = linear(g, x, prefix + "ffn_gate_inp.weight")
    if moe.gating == "softmax":
        probs = g.op("Softmax", [logits], axis=-1)
    else:
        # 1 / (1 + exp(-x)), not ORT's Sigmoid: that one is accurate in absolute terms only (measured on
        # CPU: relative error 2e-4 at x = -8, over 100 % near -18), and normalising turns small scores
        # into large weights. This form stays within 1.3e-7 relative on [-20, 20].
        one = g.const(1.0, np.float32)
        probs = g.op("Reciprocal", [g.op("Add", [g.op("Exp", [g.op("Neg", [logits])]), one])])
    scores = probs
    if moe.selection_bias:
        bias = g.init(prefix + "exp_probs_b.bias", weights[prefix + "exp_probs_b.bias"].astype(np.float32))
        scores = g.op("Add", [probs, bias])
    _, chosen = g.ops("TopK", [scores, g.const([moe.n_expert_used])], 2, axis=-1, largest=1, sorted=1)
    w = g.op("GatherElements", [probs, chosen], axis=-1)
    if moe.norm_weights:
        total = g.op("ReduceSum", [w, g.const([-1])], keepdims=1)
        w = g.op("Div", [w, g.op("Max", [total, g.const(WEIGHT_SUM_MIN, np.float32)])])
    if moe.weights_scale != 1.0:
        w = g.op("Mul", [w, g.const(moe.weights_scale, np.float32)])
    return chosen, w


def _router_input(g: GraphBuilder, chosen: str, w: str, n_expert: int) -> str:
    """[.., n_expert]: log(w) at the chosen experts, -1e30 elsewhere (the op's softmax gives w / sum w)."""
    log_w = g.op("Log", [g.op("Max", [w, g.const(_WEIGHT_MIN, np.float32)])])
    lead = g.op("Slice", [g.op("Shape", [chosen]), g.const([0]), g.const([-1])])
    blank = g.op("Expand", [g.const(_NOT_CHOSEN, np.float32),
                            g.op("Concat", [lead, g.const([n_expert])], axis=0)])
    return g.op("ScatterElements", [blank, chosen, log_w], axis=-1)


def _picked(g: GraphBuilder, x: str, width: int) -> str:
    """The rows of x named by ``moe_rows``, copies included, as [n * copies, width]."""
    rows = g.op("Gather", [g.op("Reshape", [x, g.const([-1, width])]), MOE_ROWS], axis=0)  # [n, copies, width]
    return g.op("Reshape", [rows, g.const([-1, width])])


def moe_ffn(g: GraphBuilder, linear: LinearFn, weights: dict[str, np.ndarray], moe: MoEParams, x: str,
            prefix: str, n_embd: int) -> str:
    """The block's FFN output for x [B, T, n_embd]: routed experts (+ the shared expert)."""
    chosen, w = route(g, linear, weights, moe, x, prefix)
    router_in = _router_input(g, chosen, w, moe.n_expert)
    fc1 = g.init(prefix + "ffn_gate_up_exps.fused", fused_gate_up(weights[prefix + "ffn_gate_exps.weight"],
                                                                  weights[prefix + "ffn_up_exps.weight"]))
    fc2 = g.init(prefix + "ffn_down_exps.weight", weights[prefix + "ffn_down_exps.weight"].astype(np.float32))
    mixed = g.op("MoE", [_picked(g, x, n_embd), _picked(g, router_in, moe.n_expert), fc1, "", fc2],
                 domain=MS_DOMAIN, k=moe.n_expert_used, activation_type="swiglu", swiglu_fusion=1,
                 normalize_routing_weights=1)
    # Every copy of a row computed the same value: keep the first, put it back at its row.
    per_copy = g.op("Reshape", [mixed, g.op("Concat", [g.op("Shape", [MOE_ROWS]), g.const([n_embd])], axis=0)])
    first = g.op("Reshape", [g.op("Gather", [per_copy, g.const([0])], axis=1), g.const([-1, n_embd])])  # [n, n_embd]
    row_ids = g.op("Gather", [MOE_ROWS, g.const([0])], axis=1)  # [n, 1]
    flat_x = g.op("Reshape", [x, g.const([-1, n_embd])])
    zeros = g.op("Expand", [g.const(0.0, np.float32), g.op("Shape", [flat_x])])
    routed = g.op("Reshape", [g.op("ScatterND", [zeros, row_ids, first]), g.op("Shape", [x])])
    out = g.op("Mul", [routed, g.op("ReduceSum", [w, g.const([-1])], keepdims=1)])
    if moe.n_expert_shared:
        out = g.op("Add", [out, swiglu_ffn(g, linear, x, prefix, "_shexp")])
    return out
