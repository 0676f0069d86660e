"""OnnxBackend on the tiny MoE fixtures (qwen3moe, glm4moe): logits against transformers, exact mode
bitwise under chunking, batched mode, the routing rule on constructed cases, broken files."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from spekula.backends.gguf.architecture import MoEParams
from spekula.backends.gguf.weights import dequantize
from spekula.core.backend import BackendOptions, SeqInput
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures.tiny_gguf import write_gguf
from spekula.fixtures.tiny_moe import MOE_ARCHS, tiny_moe_gguf_path, tiny_moe_hf_path

onnx_backend = pytest.importorskip("spekula.backends.onnx.backend")
ort = pytest.importorskip("onnxruntime")

from backend_helpers import chunked_logits  # noqa: E402

from spekula.backends.onnx.builder import MS_DOMAIN, MS_OPSET, GraphBuilder, linear_f32  # noqa: E402
from spekula.backends.onnx.graph import IR_VERSION, OPSET  # noqa: E402
from spekula.backends.onnx.moe import MOE_ROWS, moe_ffn, moe_rows  # noqa: E402

OnnxBackend = onnx_backend.OnnxBackend
# Same bound as the dense fixtures' batched mode (tests/test_onnx_backend.py).
BATCH_TOL = 1e-4
# (arch, MTP layers): the trunk forward must ignore MTP blocks stored after it.
CASES = [("qwen3moe", 0), ("glm4moe", 0), ("glm4moe", 1)]
CASE_IDS = ["qwen3moe", "glm4moe", "glm4moe-mtp"]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "onnx-cache"))


def _backend(arch: str, n_mtp: int = 0, **kw: object) -> OnnxBackend:
    opts = BackendOptions(n_ctx=256, n_seq_max=4, threads=1, **kw)
    return OnnxBackend(tiny_moe_gguf_path(arch, n_mtp=n_mtp), opts)


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 320, n).astype(np.int32)


@pytest.mark.parametrize(("arch", "n_mtp"), CASES, ids=CASE_IDS)
def test_logits_match_transformers(arch: str, n_mtp: int) -> None:
    """transformers' Qwen3Moe / Glm4Moe (its own routing code) agrees on every row."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    ids = _tokens(37, seed=1)
    be = _backend(arch, n_mtp)
    seq = be.new_seq()
    ours = be.forward([SeqInput(seq, ids, 0, np.arange(len(ids)))])[0].logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_moe_hf_path(arch, n_mtp=n_mtp)),
                                                                  dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert be.info.n_layer == 3
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_exact_mode_is_bitwise_invariant_to_chunking(arch: str) -> None:
    """Each expert's GEMM row count depends on the chunk; exact mode must not let that show."""
    be = _backend(arch)
    ids = _tokens(41, seed=2)
    seq = be.new_seq()
    whole = be.forward([SeqInput(seq, ids, 0, np.arange(41))])[0].logits
    for sizes in ((3, 1, 1, 9, 2, 25), (1,) * 41):
        be.truncate(seq, 0)
        assert np.array_equal(chunked_logits(be, seq, ids, sizes), whole), sizes


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_batched_mode_matches_exact_alone(arch: str) -> None:
    """Batched runs pad sequences to one length; the padding rows must not disturb the real ones."""
    exact, batched = _backend(arch), _backend(arch, exact=False)
    seqs = [_tokens(n, seed=20 + n) for n in (5, 23, 1)]
    alone = []
    for t in seqs:
        s = exact.new_seq()
        alone.append(exact.forward([SeqInput(s, t, 0, np.arange(t.size))])[0].logits)
        exact.free_seq(s)
    ids = [batched.new_seq() for _ in seqs]
    outs = batched.forward([SeqInput(i, t, 0, np.arange(t.size)) for i, t in zip(ids, seqs, strict=True)])
    for o, want in zip(outs, alone, strict=True):
        np.testing.assert_allclose(o.logits, want, atol=BATCH_TOL, rtol=0)


# ---- the routing rule on constructed inputs --------------------------------------------------------

H, E, F = 16, 4, 8


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def _reference(x: np.ndarray, w: dict[str, np.ndarray], moe: MoEParams, sum_min: float = 6.103515625e-5) -> np.ndarray:
    """The routing rule of backends/gguf/moe.py, one row at a time in float64."""
    out = np.zeros(x.shape, dtype=np.float64)
    for r, row in enumerate(x.astype(np.float64)):
        logits = w["ffn_gate_inp.weight"] @ row
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() if moe.gating == "softmax" \
            else 1.0 / (1.0 + np.exp(-logits))
        scores = probs + w.get("exp_probs_b.bias", np.zeros(E))
        chosen = np.argsort(-scores, kind="stable")[: moe.n_expert_used]  # ties: lower index first
        weights = probs[chosen]
        if moe.norm_weights:
            weights = weights / max(weights.sum(), sum_min)
        weights = weights * moe.weights_scale
        for e, we in zip(chosen, weights, strict=True):
            act = _silu(w["ffn_gate_exps.weight"][e] @ row) * (w["ffn_up_exps.weight"][e] @ row)
            out[r] += we * (w["ffn_down_exps.weight"][e] @ act)
        if moe.n_expert_shared:
            act = _silu(w["ffn_gate_shexp.weight"] @ row) * (w["ffn_up_shexp.weight"] @ row)
            out[r] += w["ffn_down_shexp.weight"] @ act
    return out


def _run_moe_graph(x: np.ndarray, w: dict[str, np.ndarray], moe: MoEParams, copies: int) -> np.ndarray:
    g = GraphBuilder()
    g.rename_output(moe_ffn(g, linear_f32(w), w, moe, "x", "", H), "y")
    graph = helper.make_graph(
        g.nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", H]),
                         helper.make_tensor_value_info(MOE_ROWS, TensorProto.INT64, ["M", "C"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", H])],
        initializer=[onnx.numpy_helper.from_array(a, n) for n, a in g.initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, MS_OPSET)])
    model.ir_version = IR_VERSION
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"x": x[None], MOE_ROWS: moe_rows(np.arange(len(x)), copies)}
    return sess.run(["y"], feed)[0][0]


def _weights(rng: np.random.Generator, *, shared: bool, bias: np.ndarray | None) -> dict[str, np.ndarray]:
    def mat(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {"ffn_gate_inp.weight": mat(E, H), "ffn_gate_exps.weight": mat(E, F, H), "ffn_up_exps.weight": mat(E, F, H),
         "ffn_down_exps.weight": mat(E, H, F)}
    # Experts 1 and 2 get the same router row: their probabilities tie exactly on every input.
    w["ffn_gate_inp.weight"][2] = w["ffn_gate_inp.weight"][1]
    if bias is not None:
        w["exp_probs_b.bias"] = bias.astype(np.float32)
    if shared:
        w |= {"ffn_gate_shexp.weight": mat(F, H), "ffn_up_shexp.weight": mat(F, H), "ffn_down_shexp.weight": mat(H, F)}
    return w


ROUTINGS = {
    "qwen3moe": (MoEParams(E, 2, F, 0, 0, "softmax", True, 1.0, False), None),
    "glm4moe": (MoEParams(E, 2, F, 1, 1, "sigmoid", True, 2.5, True), np.array([0.0, 0.3, -0.2, 0.5])),
    "sigmoid-unnormalised": (MoEParams(E, 3, F, 0, 0, "sigmoid", False, 1.0, True), np.array([0.4, 0.0, 0.0, -0.4])),
}


@pytest.mark.parametrize("copies", [1, 4])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_routing_rule(routing: str, copies: int) -> None:
    """Selection by probs + bias with index-order ties, mixing by the unbiased probs, clamp, scale."""
    moe, bias = ROUTINGS[routing]
    rng = np.random.default_rng(3)
    w = _weights(rng, shared=bool(moe.n_expert_shared), bias=bias)
    x = rng.standard_normal((24, H)).astype(np.float32) * 0.5
    x[-4:] *= 40.0  # saturated routers: sigmoid probabilities far below the clamp, exact softmax ties
    want = _reference(x, w, moe)
    got = _run_moe_graph(x, w, moe, copies)
    scale = np.maximum(1.0, np.abs(want).max(axis=-1, keepdims=True))
    np.testing.assert_array_less(np.abs(got - want) / scale, 1e-5)


def test_routing_rule_near_zero_weights_are_clamped() -> None:
    """All chosen sigmoid probabilities ~1e-7: their sum is clamped at 2^-14 before normalising."""
    moe = MoEParams(E, 2, F, 0, 1, "sigmoid", True, 2.5, True)
    rng = np.random.default_rng(4)
    w = _weights(rng, shared=False, bias=np.array([0.0, 0.3, -0.2, 0.5]))
    w["ffn_gate_inp.weight"] = np.repeat(np.array([[-15.0], [-16.0], [-16.0], [-17.0]], np.float32) / H, H, axis=1)
    x = (1.0 + 0.01 * rng.standard_normal((4, H))).astype(np.float32)  # logits ~ -15, -16, -16, -17
    want = _reference(x, w, moe)
    unclamped = _reference(x, w, moe, sum_min=0.0)
    assert np.abs(want).max() * 100 < np.abs(unclamped).max()  # the clamp matters here
    np.testing.assert_allclose(_run_moe_graph(x, w, moe, 1), want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


# ---- other files: q4, broken ----------------------------------------------------------------------


def _rewrite(src: Path, dst: Path, *, drop: str | None = None, q8: bool = False) -> Path:
    """A copy of a GGUF without tensor `drop`, or with every matrix (experts too) stored as Q8_0."""
    f = GGUFFile(src)
    assert drop is None or f.has_tensor(drop)
    tensors = {}
    for e in f.tensors():
        if e.name != drop:
            a = dequantize(e)
            tensors[e.name] = (a, "Q8_0") if q8 and a.ndim >= 2 and a.shape[-1] % 32 == 0 else a
    keys = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    return write_gguf(dst, f.architecture, {}, tensors, keys)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_q4_format_packs_linears_and_stays_exact(tmp_path: Path, arch: str) -> None:
    """dtype q4: router, attention and shared expert as MatMulNBits, experts dequantized into MoE;
    exact mode still bitwise under chunking (speculation on a q4 target stays lossless)."""
    path = _rewrite(tiny_moe_gguf_path(arch), tmp_path / "q8.gguf", q8=True)
    be = OnnxBackend(path, BackendOptions(n_ctx=64, n_seq_max=1, threads=1, dtype="q4"))
    graph = onnx.load(str(be.export.path), load_external_data=False).graph
    contrib = {n.op_type for n in graph.node if n.domain == MS_DOMAIN}
    assert contrib == {"MatMulNBits", "MoE"}
    ids = _tokens(41, seed=2)
    seq = be.new_seq()
    whole = be.forward([SeqInput(seq, ids, 0, np.arange(41))])[0].logits
    be.truncate(seq, 0)
    assert np.array_equal(chunked_logits(be, seq, ids, (3, 1, 1, 9, 2, 25)), whole)


@pytest.mark.parametrize(("arch", "drop"), [
    ("qwen3moe", "blk.1.ffn_up_exps.weight"),
    ("glm4moe", "blk.2.ffn_down_exps.weight"),
    ("glm4moe", "blk.1.exp_probs_b.bias"),
    ("glm4moe", "blk.2.ffn_gate_shexp.weight"),
])
def test_missing_moe_tensor_is_one_model_file_error(tmp_path: Path, arch: str, drop: str) -> None:
    broken = _rewrite(tiny_moe_gguf_path(arch), tmp_path / "broken.gguf", drop=drop)
    with pytest.raises(ModelFileError, match=rf"broken\.gguf: missing tensor '{drop}'"):
        OnnxBackend(broken, BackendOptions(n_ctx=64, n_seq_max=1, threads=1))
