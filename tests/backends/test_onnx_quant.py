"""MatMulNBits packing of GGUF Q4_0 / Q4_1 / Q8_0 blocks, and the opt-in q4 weight format."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from spekula.core.backend import BackendOptions, SeqInput
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures.tiny_gguf import tiny_model_path, write_gguf

ort = pytest.importorskip("onnxruntime")
from backend_helpers import chunked_logits  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from spekula.backends.onnx.graph import IR_VERSION, MS_DOMAIN, MS_OPSET, OPSET, GraphBuilder  # noqa: E402
from spekula.backends.onnx.quant import linear_q4  # noqa: E402

N, K = 24, 96  # three 32-blocks per row


def _one_linear(path: Path, name: str, accuracy_level: int) -> ort.InferenceSession:
    """A graph with a single q4 linear layer for tensor `name` of the GGUF at `path`."""
    f = GGUFFile(path)
    g = GraphBuilder()
    x = g.op("Identity", ["x"])
    y = linear_q4(f, {}, accuracy_level)(g, x, name)
    g.rename_output(y, "y")
    graph = helper.make_graph(g.nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", N])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, MS_OPSET)])
    model.ir_version = IR_VERSION
    from spekula.backends.onnx.graph import BuiltGraph

    full = BuiltGraph(model, g.initializers).with_inline_weights()
    assert any(n.op_type == "MatMulNBits" for n in full.graph.node)
    return ort.InferenceSession(full.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_packing_reproduces_the_dequantized_weight(tmp_path: Path, qtype: str) -> None:
    rng = np.random.default_rng(7)
    w = rng.normal(size=(N, K)).astype(np.float32)
    w[3, 32:64] = 0.25  # a constant block: Q4_1 stores d = 0 there
    path = tmp_path / "w.gguf"
    write_gguf(path, "llama", {}, {"w": (w, qtype)}, {})
    entry = GGUFFile(path).tensor("w")
    deq = gguf.quants.dequantize(entry.data, gguf.GGMLQuantizationType[qtype]).reshape(N, K)
    x = rng.normal(size=(1, 5, K)).astype(np.float32)
    # accuracy level 0: fp32 activations, so only the packing can make a difference
    got = _one_linear(path, "w", 0).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, x @ deq.T, atol=2e-5, rtol=1e-5)
    # level 4 (what the q4 format uses) quantizes the activations: close, not exact
    approx = _one_linear(path, "w", 4).run(None, {"x": x})[0]
    assert np.abs(approx - x @ deq.T).max() < 0.05 * np.abs(x @ deq.T).max()


def test_q4_format_runs_and_stays_near_f32(tmp_path_factory: pytest.TempPathFactory,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "onnx-cache"))
    from spekula.backends.onnx.backend import OnnxBackend

    path = tiny_model_path("llama")  # its FFN weights are Q8_0
    ids = np.random.default_rng(3).integers(0, 320, 20).astype(np.int32)
    out = {}
    for dtype in ("f32", "q4"):
        be = OnnxBackend(path, BackendOptions(dtype=dtype, threads=1, n_ctx=64))
        assert be.export.weight_format == dtype
        out[dtype] = be.forward([SeqInput(be.new_seq(), ids, 0, np.arange(20))])[0].logits
    assert not np.array_equal(out["q4"], out["f32"])  # the quantized path really ran
    # int8 activations move logits by a few percent of their range, but not their shape
    corr = np.corrcoef(out["q4"].ravel(), out["f32"].ravel())[0, 1]
    agree = float((out["q4"].argmax(-1) == out["f32"].argmax(-1)).mean())
    print(f"q4 vs f32: max diff {np.abs(out['q4'] - out['f32']).max():.3g}, corr {corr:.5f}, argmax agree {agree:.2f}")
    assert corr > 0.99 and agree >= 0.8


def test_q4_exact_mode_is_chunking_invariant(tmp_path_factory: pytest.TempPathFactory,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 activations are quantized per row and block, so padded exact-mode runs stay bitwise
    invariant: speculative decoding on a q4 target is lossless with respect to q4 plain decoding."""
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "onnx-cache"))
    from spekula.backends.onnx.backend import OnnxBackend

    be = OnnxBackend(tiny_model_path("llama"), BackendOptions(dtype="q4", threads=1, n_ctx=64))
    seq = be.new_seq()
    ids = np.random.default_rng(4).integers(0, 320, 41).astype(np.int32)
    whole = be.forward([SeqInput(seq, ids, 0, np.arange(41))])[0].logits
    be.truncate(seq, 0)
    assert np.array_equal(chunked_logits(be, seq, ids, (3, 1, 1, 9, 2, 25)), whole)
