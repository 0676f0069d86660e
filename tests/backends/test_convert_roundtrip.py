"""HF checkpoint -> `spekula convert` -> GGUF -> draft runtime gives the HF reference's logits (fp32, 1e-4).

The reference (tests/hf_reference.py) uses HF names, rotate_half rope on un-permuted weights and d2t
offsets; the runtime uses the GGUF (permuted Q/K, interleaved rope for EAGLE-3, absolute d2t), so
agreement checks the converter's permutation, renaming and d2t rewrite, and the runtime's math.
"""

from __future__ import annotations

from pathlib import Path

import hf_reference as R
import numpy as np
import pytest
import torch

from spekula.backends.convert.hf import convert
from spekula.core.backend import ModelInfo
from spekula.core.drafting.draft_models import DFlashBlock, Eagle3Rows
from spekula.drafters.model.runtimes import load_draft_runtime
from spekula.fixtures import tiny_hf

TOKENS = [5, 17, 200, 33, 99, 120, 7, 8, 250, 11, 64, 3]
TOL = 1e-4


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelInfo, list[torch.Tensor]]:
    root = tmp_path_factory.mktemp("target")
    hf = tiny_hf.write_target(root / "hf", "llama", n_layer=8)
    out = root / "target.gguf"
    convert(hf, out, outtype="f32")
    _, states = R.target_forward(hf, TOKENS)
    info = ModelInfo(str(out), "llama", "tiny", tiny_hf.VOCAB, tiny_hf.HIDDEN, 8, 2048)
    return hf, info, [s.float() for s in states]


def _features(states: list[torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([states[i] for i in layers], dim=-1)


def _close(got: np.ndarray, ref: torch.Tensor) -> None:
    want = ref.numpy()
    assert np.array_equal(np.isfinite(got), np.isfinite(want)), "draft-vocabulary masks differ"
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=TOL, rtol=0)


EAGLE3_CASES = {
    "specforge": {"layout": "specforge"},
    "vllm": {"layout": "vllm"},
    "speculators": {"layout": "speculators"},
    "own-embed-norm-fc": {"layout": "specforge", "own_embed": True, "norm_before_fc": True, "norm_before_residual": True},
    "no-head-full-vocab": {"layout": "specforge", "own_head": False, "draft_vocab": tiny_hf.VOCAB},
}


@pytest.mark.parametrize("case", list(EAGLE3_CASES))
def test_eagle3_round_trip(case: str, target: tuple[Path, ModelInfo, list[torch.Tensor]], tmp_path: Path) -> None:
    hf_target, info, states = target
    draft = tiny_hf.write_eagle3(tmp_path / "hf", **EAGLE3_CASES[case])
    gguf_path = tmp_path / "draft.gguf"
    assert convert(draft, gguf_path, outtype="f32", target_dir=hf_target)[0] == "eagle3"
    rt = load_draft_runtime("torch", str(gguf_path), info)
    assert rt.info.target_layers == (1, 4, 6)
    feats = _features(states, rt.info.target_layers)[:-1]
    ref_logits, ref_prenorm = R.eagle3_forward(draft, hf_target, feats, TOKENS[1:])
    seq = rt.new_seq()
    g = rt.encode(feats.numpy())
    # Two chunks: the second must see the first through the KV cache.
    a = rt.decode([Eagle3Rows(seq, np.array(TOKENS[1:6]), g[:5], 0)])[0]
    b = rt.decode([Eagle3Rows(seq, np.array(TOKENS[6:]), g[5:], 5)])[0]
    assert a.logits is not None and b.logits is not None
    _close(np.concatenate([a.logits, b.logits]), ref_logits.float())
    np.testing.assert_allclose(np.concatenate([a.prenorm, b.prenorm]), ref_prenorm.float().numpy(), atol=TOL)


def test_eagle3_truncate_and_chained_step(target: tuple[Path, ModelInfo, list[torch.Tensor]], tmp_path: Path) -> None:
    """A rewritten position replaces the stale entry; a step fed its own pre-norm matches the reference."""
    hf_target, info, states = target
    draft = tiny_hf.write_eagle3(tmp_path / "hf")
    gguf_path = tmp_path / "draft.gguf"
    convert(draft, gguf_path, outtype="f32", target_dir=hf_target)
    rt = load_draft_runtime("torch", str(gguf_path), info)
    feats = _features(states, rt.info.target_layers)[:6]
    g = rt.encode(feats.numpy())
    seq = rt.new_seq()
    rt.decode([Eagle3Rows(seq, np.array([9, 9, 9, 9, 9, 9]), g, 0, want_logits=False)])
    rt.truncate(seq, 3)
    assert rt.seq_len(seq) == 3
    out = rt.decode([Eagle3Rows(seq, np.array(TOKENS[4:7]), g[3:], 3)])[0]
    rows = [9, 9, 9, *TOKENS[4:7]]
    ref_logits, ref_prenorm = R.eagle3_forward(draft, hf_target, feats, rows)
    assert out.logits is not None
    _close(out.logits, ref_logits[3:].float())
    # Chained step: (d, pre-norm of the last row) at the next position, as drafting does.
    step = rt.decode([Eagle3Rows(seq, np.array([42]), out.prenorm[-1:], 6)])[0]
    g_all = torch.cat([torch.from_numpy(g), torch.from_numpy(out.prenorm[-1:])])
    ref_chain, _ = R.eagle3_layer(draft, hf_target, g_all, [*rows, 42])
    assert step.logits is not None
    _close(step.logits, ref_chain[-1:].float())


DFLASH_CASES = {
    "dflash": ({}, "dflash"),
    "dflash-causal": ({"causal": True}, "dflash"),
    "dspark-anchor": ({"markov_rank": 8}, "dspark"),
    "dspark-bonus-anchor": ({"markov_rank": 8, "sample_from_anchor": False}, "dspark"),
    "dspark-reduced-vocab": ({"markov_rank": 8, "draft_vocab": 96, "confidence": False}, "dspark"),
    "dspark-speculators": ({"markov_rank": 8, "speculators": True}, "dspark"),
}


@pytest.mark.parametrize("case", list(DFLASH_CASES))
def test_dflash_round_trip(case: str, target: tuple[Path, ModelInfo, list[torch.Tensor]], tmp_path: Path) -> None:
    hf_target, info, states = target
    kwargs, kind = DFLASH_CASES[case]
    draft = tiny_hf.write_dflash(tmp_path / "hf", **kwargs)
    gguf_path = tmp_path / "draft.gguf"
    assert convert(draft, gguf_path, outtype="f32", target_dir=hf_target)[0] == kind
    rt = load_draft_runtime("torch", str(gguf_path), info)
    assert rt.info.kind == kind and rt.info.target_layers == (2, 7)  # HF ids (1, 6) + 1
    feats = _features(states, rt.info.target_layers)
    P = 7
    seq = rt.new_seq()
    rt.inject(seq, feats[:4].numpy(), 0)  # context arrives in two chunks, like prompt ubatches
    rt.inject(seq, feats[4:P].numpy(), 4)
    block = [TOKENS[P], *([rt.info.mask_token_id] * 3)]
    out = rt.draft_blocks([DFlashBlock(seq, np.array(block), P)])[0]
    if kind == "dflash":
        ref, _ = R.dflash_forward(draft, hf_target, feats[:P], block)
        assert out.confidence is None
    else:
        ref, conf = R.dspark_forward(draft, hf_target, feats[:P], block, anchor_first=rt.info.sample_from_anchor)
        if conf is None:
            assert out.confidence is None
        else:
            assert out.confidence is not None
            np.testing.assert_allclose(out.confidence, conf.float().numpy(), atol=TOL)
    _close(out.logits, ref.float())
    # The block's K/V must not leak into the next draft: redraft after truncating to the context.
    rt.truncate(seq, P)
    again = rt.draft_blocks([DFlashBlock(seq, np.array(block), P)])[0]
    np.testing.assert_array_equal(again.logits, out.logits)


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
def test_half_precision_outtypes_load(outtype: str, target: tuple[Path, ModelInfo, list[torch.Tensor]], tmp_path: Path) -> None:
    hf_target, info, states = target
    draft = tiny_hf.write_eagle3(tmp_path / "hf")
    path = tmp_path / "draft.gguf"
    convert(draft, path, outtype=outtype, target_dir=hf_target)
    from spekula.core.modelfile.gguf_file import GGUFFile

    f = GGUFFile(path)
    assert f.tensor("fc.weight").type_name == outtype.upper()
    assert f.tensor("output_norm.weight").type_name == "F32"
    rt = load_draft_runtime("torch", str(path), info)
    feats = _features(states, rt.info.target_layers)[:-1]
    ref, _ = R.eagle3_forward(draft, hf_target, feats, TOKENS[1:])
    out = rt.decode([Eagle3Rows(rt.new_seq(), np.array(TOKENS[1:]), rt.encode(feats.numpy()), 0)])[0]
    assert out.logits is not None
    fin = np.isfinite(ref.numpy())
    assert np.abs(out.logits[fin] - ref.numpy()[fin]).max() < 0.1  # half-precision weights, not exact
