"""draft-dspark: anchor-first and bonus-anchor block layouts, Markov-chained greedy drafts, confidence gating."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from model_drafter_helpers import build_target, drafter_context, engine_vs_plain, target_backend

from spekula.backends.convert.hf import convert
from spekula.core.backend import Capture, SeqInput
from spekula.core.drafting.draft_models import DFlashBlock
from spekula.core.drafting.drafter import DraftRequest
from spekula.core.errors import ConfigError
from spekula.core.params import SpecParams
from spekula.drafters.model.dflash import DFlashDrafter
from spekula.drafters.model.dspark import DSparkDrafter
from spekula.fixtures import tiny_hf

SPEC = SpecParams(types=("draft-dspark",), n_max=4, adaptive=False)  # full-length drafts: they are what is checked
PROMPT = [5, 17, 200, 33, 99, 120, 7, 8]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dspark")
    hf, target = build_target(root)
    out = {"target": target, "hf": hf}
    for name, kw in {"anchor": {}, "bonus": {"sample_from_anchor": False}, "noconf": {"confidence": False}}.items():
        out[name] = root / f"{name}.gguf"
        convert(tiny_hf.write_dflash(root / name, markov_rank=8, **kw), out[name], outtype="f32", target_dir=hf)
    return out


def test_random_draft_is_lossless_through_the_engine(models: dict[str, Path]) -> None:
    outs, refs, st = engine_vs_plain(models["target"], models["anchor"], DSparkDrafter.create, SPEC)
    assert outs == refs and st["gen_drafts"] > 0


def _ready(models: dict[str, Path], name: str, spec: SpecParams = SPEC) -> DSparkDrafter:
    target = target_backend(models["target"])
    d = DSparkDrafter.create(drafter_context(target, models[name], spec))
    inp = SeqInput(target.new_seq(), np.array(PROMPT, dtype=np.int32), 0)
    d.observe(0, inp, target.forward([inp], Capture(layers=frozenset(d.layers)))[0])
    d.begin(0, np.array(PROMPT))
    assert d.sync(d._slots.get(0), len(PROMPT))  # the prompt's context injected, for tests that read the runtime
    return d


@pytest.mark.parametrize(("name", "block_len", "rows"), [("anchor", 4, [0, 1, 2, 3]), ("bonus", 4, [1, 2, 3])])
def test_block_layouts(models: dict[str, Path], name: str, block_len: int, rows: list[int]) -> None:
    d = _ready(models, name)
    (draft,) = d.draft([DraftRequest(0, np.array(PROMPT), 42, 8, SPEC, 0.0, 0)])
    block = np.array([42] + [d.info.mask_token_id] * (block_len - 1), dtype=np.int32)
    (out,) = d.runtime.draft_blocks([DFlashBlock(d._slots.get(0).seq, block, len(PROMPT))])
    assert draft.tokens == [int(np.argmax(out.logits[j])) for j in rows]


def test_confidence_gates_p_min(models: dict[str, Path]) -> None:
    d = _ready(models, "anchor")
    seq = d._slots.get(0).seq
    block = np.array([42] + [d.info.mask_token_id] * 3, dtype=np.int32)
    (out,) = d.runtime.draft_blocks([DFlashBlock(seq, block, len(PROMPT))])
    assert out.confidence is not None
    conf = out.confidence
    for p in sorted({*conf.tolist(), 0.5}):
        (draft,) = d.draft([DraftRequest(0, np.array(PROMPT), 42, 8, SPEC.with_(p_min=float(p)), 0.0, 0)])
        below = np.flatnonzero(conf < p)
        assert len(draft.tokens) == (int(below[0]) if len(below) else 4)


def test_p_min_without_confidence_head_is_an_error(models: dict[str, Path]) -> None:
    target = target_backend(models["target"])
    with pytest.raises(ConfigError, match="confidence"):
        DSparkDrafter.create(drafter_context(target, models["noconf"], SPEC.with_(p_min=0.5)))
    DSparkDrafter.create(drafter_context(target, models["noconf"], SPEC))  # fine without p_min
    with pytest.raises(ConfigError, match="draft-dspark"):
        DFlashDrafter.create(drafter_context(target, models["anchor"], SPEC))


def test_oracle_draft_is_fully_accepted(tmp_path: Path) -> None:
    """Anchor-first DSpark over a target that repeats its last token: block_size drafts per round, all accepted."""
    target_hf = tiny_hf.write_bigram_target(tmp_path / "rep", identity=True)
    target = tmp_path / "rep.gguf"
    convert(target_hf, target, outtype="f32")
    draft = tmp_path / "oracle.gguf"
    convert(tiny_hf.write_dflash_oracle(tmp_path / "oracle", markov_rank=4), draft, outtype="f32", target_dir=target_hf)
    spec = SPEC.with_(p_min=0.9)  # confidence sigmoid(5) ~ 0.993 passes the gate
    outs, refs, st = engine_vs_plain(target, draft, DSparkDrafter.create, spec, n_predict=20)
    assert outs == refs
    assert st["acc_tokens"] == st["gen_tokens"] > 0
    assert st["gen_tokens"] >= 4 * (st["gen_drafts"] - 2)  # 4 = block_size drafts per round (anchor-first)


def test_drafts_made_in_the_engine_equal_a_from_scratch_reference(models: dict[str, Path]) -> None:
    """Anchor-first DSpark drafts from the engine equal the HF-formulation Markov chain recomputed from
    scratch (chained logits within 1e-4, confidences too)."""
    import hf_reference as R
    import torch
    from model_drafter_helpers import (
        agree_unless_near_tie,
        assert_logits_close,
        block_logits,
        recorded_drafts,
    )

    log = recorded_drafts(models["target"], models["anchor"], DSparkDrafter.create, SPEC, probe=block_logits)
    draft_hf = models["anchor"].parent / "anchor"
    checked = 0
    for history, last, tokens, probed in log:
        _, states = R.target_forward(models["hf"], history)
        feats = torch.cat([states[i] for i in (2, 7)], dim=-1)
        block = [last] + [tiny_hf.VOCAB - 1] * (SPEC.n_max - 1)
        logits, _ = R.dspark_forward(draft_hf, models["hf"], feats, block, anchor_first=True)
        n_ok = agree_unless_near_tie(tokens, [logits[j].numpy() for j in range(len(tokens))])
        # The chain conditions on each argmax, so rows are comparable up to the first near-tie.
        assert_logits_close(probed[: n_ok + 1], logits.numpy()[: n_ok + 1])
        checked += n_ok
    assert len(log) > 10 and checked > 2 * len(log)
