"""Torch backend, MoE targets: exact-mode invariance through routed experts, the router's top-k and
weights, the grouped expert GEMMs against a per-token loop, and broken expert tensors.

Agreement with transformers is in test_moe_reference.py; this file is about what the references
cannot see: a row's bits must not depend on which other rows were routed to the same experts.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from spekula.backends.gguf.architecture import MoEParams
from spekula.backends.gguf.weights import dequantize
from spekula.backends.torch.backend import TorchBackend
from spekula.backends.torch.exact_probe import choose_exact_gemm
from spekula.backends.torch.linear import planned_lin
from spekula.backends.torch.moe import MoEFFN, build_moe_ffn
from spekula.core.backend import BackendOptions, SeqInput, load_backend
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures.tiny_gguf import write_gguf
from spekula.fixtures.tiny_hf import VOCAB
from spekula.fixtures.tiny_moe import MOE_ARCHS, tiny_moe_gguf_path


@cache
def backend(arch: str, onednn: bool) -> TorchBackend:
    """``onednn=False`` forces the padded-MKL exact path for every GEMM, expert GEMMs included."""
    opts = BackendOptions(n_ctx=256, n_seq_max=4, threads=1, exact=True)
    with mock.patch("spekula.backends.torch.backend.onednn_packing_available", return_value=onednn):
        b = TorchBackend(str(tiny_moe_gguf_path(arch)), opts)
    if not onednn:
        assert not b.packed
    return b


def _decode_one_by_one(b: TorchBackend, tokens: np.ndarray) -> np.ndarray:
    s = b.new_seq()
    try:
        return np.stack([b.forward([SeqInput(s, tokens[i : i + 1], i)])[0].logits[0] for i in range(tokens.size)])
    finally:
        b.free_seq(s)


@pytest.mark.parametrize("onednn", [True, False], ids=["planned", "padded"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_batched_and_chunked_rows_equal_single_token_decode(arch: str, onednn: bool) -> None:
    """Three sequences in one forward (82 rows: two tiles, each expert gets a different row count than
    alone), then one of them in uneven chunks: every row bitwise equal to decoding it token by token."""
    b = backend(arch, onednn)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (70, 9, 3)]
    alone = [_decode_one_by_one(b, t) for t in seqs]
    ids = [b.new_seq() for _ in seqs]
    try:
        outs = b.forward([SeqInput(i, t, 0, np.arange(t.size)) for i, t in zip(ids, seqs, strict=True)])
        for k, (o, want) in enumerate(zip(outs, alone, strict=True)):
            assert np.array_equal(o.logits, want), f"sequence {k}: max diff {np.abs(o.logits - want).max():.3g}"
        b.truncate(ids[0], 0)
        got, pos = [], 0
        for n in (1, 17, 5, 47):
            got.append(b.forward([SeqInput(ids[0], seqs[0][pos : pos + n], pos, np.arange(n))])[0].logits)
            pos += n
        assert np.array_equal(np.concatenate(got), alone[0])
    finally:
        for i in ids:
            b.free_seq(i)


# ---- the MoE FFN on its own ----------------------------------------------------------------------


def _moe_params(**kw: Any) -> MoEParams:
    base: dict[str, Any] = dict(n_expert=4, n_expert_used=2, n_ff_exp=4, n_expert_shared=0, n_dense_lead=0,
                                gating="softmax", norm_weights=True, weights_scale=1.0, selection_bias=False)
    return MoEParams(**(base | kw))


def _ffn(moe: MoEParams, weights: dict[str, np.ndarray], plan: Any = None) -> MoEFFN:
    def to_tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).contiguous()

    gemm = plan or (lambda n, k: (False, 1))
    return build_moe_ffn(moe, weights, "blk.0.", to_tensor=to_tensor,
                         make_lin=lambda w, b: planned_lin(gemm, w, b))


def _exact_plan(n: int, k: int) -> tuple[bool, int]:
    """The exact-mode GEMM path the backend would choose for an [n, k] weight on this CPU."""
    packed, align = choose_exact_gemm([(n, k)])
    assert align is not None
    return packed, align


def _random_weights(moe: MoEParams, H: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    E, F, S = moe.n_expert, moe.n_ff_exp, moe.n_ff_shexp

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    w = {"blk.0.ffn_gate_inp.weight": mat(E, H) * 4, "blk.0.ffn_gate_exps.weight": mat(E, F, H),
         "blk.0.ffn_up_exps.weight": mat(E, F, H), "blk.0.ffn_down_exps.weight": mat(E, H, F)}
    if moe.selection_bias:
        w["blk.0.exp_probs_b.bias"] = (rng.standard_normal(E) * 0.1).astype(np.float32)
    if S:
        w |= {"blk.0.ffn_gate_shexp.weight": mat(S, H), "blk.0.ffn_up_shexp.weight": mat(S, H),
              "blk.0.ffn_down_shexp.weight": mat(H, S)}
    return w


def test_router_ties_choose_the_lower_expert_first() -> None:
    H = 8
    v = np.linspace(-1, 1, H, dtype=np.float32)
    w = _random_weights(_moe_params(n_ff_exp=4), H, seed=0)
    w["blk.0.ffn_gate_inp.weight"] = np.stack([0 * v, v, 0 * v, v])  # experts 1 and 3 tie, so do 0 and 2
    h = torch.from_numpy(np.stack([v, -v]))
    ids, weights = _ffn(_moe_params(), w).route(h)
    assert ids.tolist() == [[1, 3], [0, 2]]
    assert torch.allclose(weights, torch.full((2, 2), 0.5))
    # sigmoid gating, a selection bias that lifts expert 2, renormalised weights scaled by 2.5
    glm = _moe_params(gating="sigmoid", selection_bias=True, weights_scale=2.5)
    w["blk.0.exp_probs_b.bias"] = np.array([0, 0, 1, 0], np.float32)
    ids, weights = _ffn(glm, w).route(h[:1])
    assert ids.tolist() == [[2, 1]]
    p1, p2 = 1 / (1 + np.exp(-float(v @ v))), 0.5  # the bias steers the choice, not the weight
    assert np.allclose(weights.numpy(), [[2.5 * p2 / (p1 + p2), 2.5 * p1 / (p1 + p2)]])


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_routing_of_a_row_does_not_depend_on_the_row_count(gating: str) -> None:
    """Top-2 of 4 over 64 rows, five routers: each row's experts and weights bitwise equal to routing it
    alone (a plain sigmoid over the [M, 4] logits fails this: its scalar tail rounds differently)."""
    moe = _moe_params(gating=gating, selection_bias=gating == "sigmoid", weights_scale=2.5)
    for seed in range(5):
        ffn = _ffn(moe, _random_weights(moe, 16, seed), _exact_plan)
        h = torch.from_numpy(np.random.default_rng(seed).standard_normal((64, 16)).astype(np.float32))
        ids, weights = ffn.route(h)
        alone = [ffn.route(h[i : i + 1]) for i in range(64)]
        assert torch.equal(ids, torch.cat([a[0] for a in alone]))
        assert torch.equal(weights, torch.cat([a[1] for a in alone]))


@pytest.mark.parametrize("glm", [False, True], ids=["softmax", "sigmoid-shared-scaled"])
def test_grouped_experts_equal_a_per_token_loop_and_are_row_invariant(glm: bool) -> None:
    """8 experts, top-3, 37 rows: the grouped GEMMs give what a per-token float64 loop gives, and with
    the exact-mode plan each row's output is bitwise the same alone as in the batch."""
    H = 16
    kw: dict[str, Any] = dict(gating="sigmoid", selection_bias=True, n_expert_shared=1, weights_scale=2.5) if glm else {}
    moe = _moe_params(n_expert=8, n_expert_used=3, n_ff_exp=8, **kw)
    w = _random_weights(moe, H, seed=1)
    h = torch.from_numpy(np.random.default_rng(2).standard_normal((37, H)).astype(np.float32))
    ffn = _ffn(moe, w, _exact_plan)
    out = ffn(h)
    ids, weights = ffn.route(h)
    assert len({tuple(sorted(r)) for r in ids.tolist()}) > 3  # the rows spread over many expert sets
    x, want = h.double().numpy(), np.zeros((37, H))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    for row in range(37):
        for e, we in zip(ids[row].tolist(), weights[row].tolist(), strict=True):
            g, u = w["blk.0.ffn_gate_exps.weight"][e] @ x[row], w["blk.0.ffn_up_exps.weight"][e] @ x[row]
            want[row] += we * (w["blk.0.ffn_down_exps.weight"][e] @ (silu(g) * u))
        if glm:
            g, u = w["blk.0.ffn_gate_shexp.weight"] @ x[row], w["blk.0.ffn_up_shexp.weight"] @ x[row]
            want[row] += w["blk.0.ffn_down_shexp.weight"] @ (silu(g) * u)
    assert np.abs(out.double().numpy() - want).max() < 1e-5
    alone = torch.cat([ffn(h[i : i + 1]) for i in range(37)])
    assert torch.equal(out, alone)
    assert torch.equal(ffn(h[5:30]), out[5:30])


# ---- broken expert tensors -----------------------------------------------------------------------


def _rewrite(tmp: Path, arch: str, change: dict[str, np.ndarray | None]) -> Path:
    """A copy of the tiny MoE GGUF with tensors replaced (array) or removed (None)."""
    f = GGUFFile(tiny_moe_gguf_path(arch))
    tensors: dict[str, Any] = {e.name: dequantize(e) for e in f.tensors()}
    for name, value in change.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    keys = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    return write_gguf(tmp / "m.gguf", arch, {}, tensors, keys)


BROKEN = {
    "missing-routed-expert": ("qwen3moe", {"blk.1.ffn_up_exps.weight": None},
                              r"missing tensor 'blk\.1\.ffn_up_exps\.weight'"),
    "expert-count": ("qwen3moe", {"blk.2.ffn_gate_exps.weight": np.zeros((3, 32, 64), np.float32)},
                     r"tensor 'blk\.2\.ffn_gate_exps\.weight' has shape \(3, 32, 64\), expected \(4, 32, 64\)"),
    "missing-selection-bias": ("glm4moe", {"blk.2.exp_probs_b.bias": None}, r"missing tensor 'blk\.2\.exp_probs_b\.bias'"),
    "shared-expert-width": ("glm4moe", {"blk.1.ffn_down_shexp.weight": np.zeros((64, 16), np.float32)},
                            r"tensor 'blk\.1\.ffn_down_shexp\.weight' has shape \(64, 16\), expected \(64, 32\)"),
    "router-shape": ("glm4moe", {"blk.1.ffn_gate_inp.weight": np.zeros((64, 4), np.float32)},
                     r"tensor 'blk\.1\.ffn_gate_inp\.weight' has shape \(64, 4\), expected \(4, 64\)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_expert_tensors_give_one_model_file_error(case: str, tmp_path: Path) -> None:
    arch, change, message = BROKEN[case]
    path = _rewrite(tmp_path, arch, change)
    with pytest.raises(ModelFileError, match=r"m\.gguf: " + message):
        load_backend("torch", str(path), BackendOptions(n_ctx=64, n_seq_max=1, threads=1))
