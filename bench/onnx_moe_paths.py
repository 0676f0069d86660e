"""Ways to run one MoE FFN in onnxruntime, timed and checked against numpy (CPU, one thread).

  contribN  backends/onnx/moe.py as shipped: standard-op routing + com.microsoft.MoE (rows grouped by
            expert), every row sent N times (exact mode sends 4, see onnx/moe.py)
  gather    standard ops: Gather each row's k expert matrices, batched MatMul over [rows, k]
  dense     standard ops: every expert on every row, weighted by a mostly-zero [rows, n_expert] matrix

Default layer: Qwen3-30B-A3B's routing (128 experts, 8 used) at half its width (hidden 1024, expert
FF 384), so the gather path's per-row copies still fit in memory for a few rows.

    .venv/bin/python bench/onnx_moe_paths.py [--hidden 1024 --ff 384 --experts 128 --used 8 --rows 4 32 128]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from spekula.backends.gguf.architecture import MoEParams
from spekula.backends.onnx.builder import MS_DOMAIN, MS_OPSET, GraphBuilder, linear_f32
from spekula.backends.onnx.graph import IR_VERSION, OPSET
from spekula.backends.onnx.moe import MOE_ROWS, fused_gate_up, moe_ffn, moe_rows, route

GATHER_MAX_BYTES = 3 << 30  # skip the gather path where its per-row weight copies would exceed this


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def reference(x: np.ndarray, w: dict[str, np.ndarray], moe: MoEParams) -> np.ndarray:
    logits = x.astype(np.float64) @ w["ffn_gate_inp.weight"].T.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros(x.shape, dtype=np.float64)
    for r in range(x.shape[0]):
        chosen = np.argsort(-probs[r], kind="stable")[: moe.n_expert_used]
        weights = probs[r, chosen] / probs[r, chosen].sum()
        for e, we in zip(chosen, weights, strict=True):
            act = _silu(w["ffn_gate_exps.weight"][e] @ x[r]) * (w["ffn_up_exps.weight"][e] @ x[r])
            out[r] += we * (w["ffn_down_exps.weight"][e] @ act)
    return out


def _gather_path(g: GraphBuilder, w: dict[str, np.ndarray], moe: MoEParams, x: str, hidden: int) -> str:
    chosen, mix = route(g, linear_f32(w), w, moe, x, "")
    fc1 = g.init("fc1", fused_gate_up(w["ffn_gate_exps.weight"], w["ffn_up_exps.weight"]))
    fc1_rows = g.op("Gather", [fc1, chosen], axis=0)  # [N, k, 2F, H]
    col = g.op("Unsqueeze", [x, g.const([1, 3])])  # [N, 1, H, 1]
    gate_up = g.op("Reshape", [g.op("MatMul", [fc1_rows, col]), g.const([0, 0, -1, 2])])  # [N, k, F, 2]
    gate, up = g.ops("Split", [gate_up], 2, axis=-1, num_outputs=2)
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])  # [N, k, F, 1]
    fc2_rows = g.op("Gather", [g.init("fc2", w["ffn_down_exps.weight"]), chosen], axis=0)  # [N, k, H, F]
    down = g.op("Squeeze", [g.op("MatMul", [fc2_rows, act]), g.const([-1])])  # [N, k, H]
    return g.op("ReduceSum", [g.op("Mul", [down, g.op("Unsqueeze", [mix, g.const([-1])])]), g.const([1])],
                keepdims=0)


def _dense_path(g: GraphBuilder, w: dict[str, np.ndarray], moe: MoEParams, x: str, hidden: int) -> str:
    chosen, mix = route(g, linear_f32(w), w, moe, x, "")
    zeros = g.op("Mul", [g.op("MatMul", [x, g.init("zeros_he", np.zeros((hidden, moe.n_expert), np.float32))]),
                         g.const(0.0, np.float32)])
    full = g.op("ScatterElements", [zeros, chosen, mix], axis=-1)  # [N, E]
    gate = g.op("MatMul", [x, g.init("gate_t", np.ascontiguousarray(w["ffn_gate_exps.weight"].transpose(0, 2, 1)))])
    up = g.op("MatMul", [x, g.init("up_t", np.ascontiguousarray(w["ffn_up_exps.weight"].transpose(0, 2, 1)))])
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])  # [E, N, F]
    down = g.op("MatMul", [act, g.init("down_t", np.ascontiguousarray(w["ffn_down_exps.weight"].transpose(0, 2, 1)))])
    weighted = g.op("Mul", [down, g.op("Unsqueeze", [g.op("Transpose", [full], perm=[1, 0]), g.const([-1])])])
    return g.op("ReduceSum", [weighted, g.const([0])], keepdims=0)


def _session(build: Callable[[GraphBuilder, str], str], hidden: int, moe_input: bool) -> ort.InferenceSession:
    g = GraphBuilder()
    out = build(g, "x")
    g.rename_output(out, "y")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", hidden])]
    if moe_input:
        inputs.append(helper.make_tensor_value_info(MOE_ROWS, TensorProto.INT64, ["M", "C"]))
    graph = helper.make_graph(g.nodes, "moe_bench", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[helper.make_tensor(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape,
                                                              a.tobytes(), raw=True) for n, a in g.initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, MS_OPSET)])
    model.ir_version = IR_VERSION
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=384)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--used", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 32, 128])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    h, f, e = args.hidden, args.ff, args.experts
    moe = MoEParams(e, args.used, f, 0, 0, "softmax", True, 1.0, False)
    rng = np.random.default_rng(0)
    def mat(*shape: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(gain / np.sqrt(shape[-1]))).astype(np.float32)

    w = {"ffn_gate_inp.weight": mat(e, h, gain=4.0), "ffn_gate_exps.weight": mat(e, f, h),
         "ffn_up_exps.weight": mat(e, f, h), "ffn_down_exps.weight": mat(e, h, f)}
    paths: dict[str, tuple[Callable[[GraphBuilder, str], str], int | None]] = {
        **{f"contrib{c}": (lambda g, x: moe_ffn(g, linear_f32(w), w, moe, x, "", h), c) for c in (1, 2, 4)},
        "gather": (lambda g, x: _gather_path(g, w, moe, x, h), None),
        "dense": (lambda g, x: _dense_path(g, w, moe, x, h), None),
    }
    print(f"hidden {h}, expert FF {f}, {e} experts, {args.used} used; ms per forward (min of {args.repeats}), "
          "max |diff| from numpy")
    for name, (build, copies) in paths.items():
        sess = _session(build, h, copies is not None)
        for n in args.rows:
            if name == "gather" and n * args.used * 3 * f * h * 4 > GATHER_MAX_BYTES:
                print(f"  {name:9s} rows {n:4d}: skipped ({n * args.used * 3 * f * h * 4 / 2**30:.1f} GiB of copies)")
                continue
            x = rng.standard_normal((n, h), dtype=np.float32)
            feed: dict[str, np.ndarray] = {"x": x}
            if copies is not None:
                feed[MOE_ROWS] = moe_rows(np.arange(n), copies)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                y = sess.run(["y"], feed)[0]
                times.append(time.perf_counter() - t0)
            diff = float(np.abs(y - reference(x, w, moe)).max())
            print(f"  {name:9s} rows {n:4d}: {min(times) * 1e3:9.2f} ms   diff {diff:.2e}")
        del sess


if __name__ == "__main__":
    main()
