"""draft-dflash through the engine: lossless output, block layout and reading, n_max clamp, context injection."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from model_drafter_helpers import build_target, drafter_context, engine_vs_plain, target_backend

from spekula.backends.convert.hf import convert
from spekula.core.backend import Capture, SeqInput
from spekula.core.drafting.drafter import DraftRequest
from spekula.core.errors import ConfigError
from spekula.core.params import SamplingParams, SpecParams
from spekula.drafters.model.dflash import DFlashDrafter
from spekula.fixtures import tiny_hf

SPEC = SpecParams(types=("draft-dflash",), n_max=3, adaptive=False)  # full-length drafts: they are what is checked
PROMPT = [5, 17, 200, 33, 99, 120, 7, 8]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dflash")
    hf, target = build_target(root)
    draft = root / "dflash.gguf"
    convert(tiny_hf.write_dflash(root / "df-hf", layer_ids=(1, 6), block_size=4), draft, outtype="f32", target_dir=hf)
    return {"target": target, "draft": draft, "hf": hf}


def test_random_draft_is_lossless_through_the_engine(models: dict[str, Path]) -> None:
    outs, refs, st = engine_vs_plain(models["target"], models["draft"], DFlashDrafter.create, SPEC)
    assert outs == refs
    assert st["gen_drafts"] > 0


def test_sampled_output_is_lossless(models: dict[str, Path]) -> None:
    sampling = SamplingParams(temperature=0.9, seed=5)
    spec = SPEC.with_(draft_sampling="probabilistic")
    outs, refs, st = engine_vs_plain(models["target"], models["draft"], DFlashDrafter.create, spec, sampling=sampling)
    assert outs == refs and st["gen_drafts"] > 0


def _setup(models: dict[str, Path], spec: SpecParams = SPEC) -> tuple[DFlashDrafter, object]:
    target = target_backend(models["target"])
    d = DFlashDrafter.create(drafter_context(target, models["draft"], spec))
    inp = SeqInput(target.new_seq(), np.array(PROMPT, dtype=np.int32), 0)
    out = target.forward([inp], Capture(layers=frozenset(d.layers)))[0]
    d.observe(0, inp, out)
    d.begin(0, np.array(PROMPT))
    return d, target


def test_block_is_read_from_index_one_and_context_persists(models: dict[str, Path]) -> None:
    d, _ = _setup(models)
    st = d._slots.get(0)
    seq = st.seq
    assert d.runtime.seq_len(seq) == 0 and d.context_length(st) == len(PROMPT)  # every prompt row queued
    req = DraftRequest(0, np.array(PROMPT), 42, 8, SPEC, 0.0, 0)
    (draft,) = d.draft([req])
    assert d.runtime.seq_len(seq) == len(PROMPT) and st.queued == 0  # injected; the block's K/V dropped again
    from spekula.core.drafting.draft_models import DFlashBlock

    block = np.array([42] + [d.info.mask_token_id] * 3, dtype=np.int32)
    (out,) = d.runtime.draft_blocks([DFlashBlock(seq, block, len(PROMPT))])
    assert draft.tokens == [int(np.argmax(out.logits[j])) for j in (1, 2, 3)]
    (again,) = d.draft([req])
    assert again.tokens == draft.tokens  # deterministic: nothing leaked from the previous block


def test_the_lazy_context_drafts_what_injecting_after_every_forward_drafts(models: dict[str, Path]) -> None:
    """Rounds in which the drafter is not asked only queue features (cut where a later forward
    rewrites them); the drafts once it is asked are those of a context injected after every forward."""
    target = target_backend(models["target"])
    lazy = DFlashDrafter.create(drafter_context(target, models["draft"], SPEC))
    eager = DFlashDrafter.create(drafter_context(target, models["draft"], SPEC))
    history = list(PROMPT)
    seqs = {id(d): target.new_seq() for d in (lazy, eager)}

    def observe(d: DFlashDrafter, tokens: list[int], start: int) -> None:
        inp = SeqInput(seqs[id(d)], np.array(tokens, dtype=np.int32), start, np.arange(len(tokens)))
        d.observe(0, inp, target.forward([inp], Capture(layers=frozenset(d.layers)))[0])

    for d in (lazy, eager):
        observe(d, history, 0)
        d.begin(0, np.array(history))
    rng = np.random.default_rng(3)
    drafts: dict[int, list[list[int]]] = {id(lazy): [], id(eager): []}
    x = 42
    for rnd in range(8):
        guess = [int(t) for t in rng.integers(0, tiny_hf.VOCAB, 3)]
        n_acc = int(rng.integers(0, 4))
        for d in (lazy, eager):
            st = d._slots.get(0)
            if rnd % 3 == 2:  # asked for a draft every third round
                drafts[id(d)].append(d.draft([DraftRequest(0, np.array(history), x, 8, SPEC, 0.0, 0)])[0].tokens)
            observe(d, [x, *guess], len(history))
            d.accept(0, n_acc, False)
            if d is eager:  # everything observed injected at once, rejected rows included
                assert d.sync(st, d.context_length(st)) and st.queued == 0
        history = [*history, x, *guess[:n_acc]]
        x = int(rng.integers(0, tiny_hf.VOCAB))
    assert drafts[id(lazy)] == drafts[id(eager)] and all(drafts[id(lazy)])
    assert lazy._slots.get(0).queued > 0  # the lazy one still holds the last rounds' rows


def test_n_max_clamped_to_block_size_minus_one(models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        d, _ = _setup(models, SPEC.with_(n_max=10))
    assert "clamped to 3" in caplog.text
    (draft,) = d.draft([DraftRequest(0, np.array(PROMPT), 42, 16, SPEC.with_(n_max=10), 0.0, 0)])
    assert len(draft.tokens) == 3
    (short,) = d.draft([DraftRequest(0, np.array(PROMPT), 42, 2, SPEC.with_(n_max=10), 0.0, 0)])
    assert short.tokens == draft.tokens[:2]  # the request budget cuts the same block's reading
    (none,) = d.draft([DraftRequest(0, np.array(PROMPT), 42, 16, SPEC.with_(n_max=10, n_min=4), 0.0, 0)])
    assert none.tokens == draft.tokens  # n_min is clamped like n_max, so 3 tokens satisfy it
    (cut,) = d.draft([DraftRequest(0, np.array(PROMPT), 42, 16, SPEC.with_(p_min=1.01), 0.0, 0)])
    assert cut.tokens == []


def test_a_short_draft_reads_the_trained_block(models: dict[str, Path]) -> None:
    """A draft shorter than the head's block still runs the whole trained block (the head drafts its
    first rows better in one) and reads its first rows; near the end of the context the block shrinks
    to what fits, never below the draft."""
    from spekula.core.drafting.draft_models import DFlashBlock

    one = SPEC.with_(n_max=1)
    d, _ = _setup(models, one)
    st = d._slots.get(0)
    (draft,) = d.draft([DraftRequest(0, np.array(PROMPT), 42, 8, one, 0.0, 0)])
    trained = np.array([42] + [d.info.mask_token_id] * (d.info.block_size - 1), dtype=np.int32)
    assert d.block_at(42, 1, len(PROMPT)).tolist() == trained.tolist()
    (out,) = d.runtime.draft_blocks([DFlashBlock(st.seq, trained, len(PROMPT))])
    assert draft.tokens == [int(np.argmax(out.logits[1]))]
    end = d.runtime.n_ctx
    assert len(d.block_at(42, 1, end - 3)) == 3  # x and two rows fit
    assert len(d.block_at(42, 2, end - 1)) == 3  # does not fit: the caller skips it
    assert d.block_drafts(2, room=100) == d.max_block_draft()


def test_missing_context_gives_no_draft(models: dict[str, Path]) -> None:
    d, _ = _setup(models)
    longer = np.array([*PROMPT, 1, 2], dtype=np.int32)  # history the draft has not seen
    (draft,) = d.draft([DraftRequest(0, longer, 42, 8, SPEC, 0.0, 0)])
    assert draft.tokens == []


def test_wrong_type_is_a_config_error(models: dict[str, Path]) -> None:
    target = target_backend(models["target"])
    e3 = models["draft"].with_name("e3.gguf")
    convert(tiny_hf.write_eagle3(e3.with_suffix("")), e3, outtype="f32", target_dir=models["hf"])
    with pytest.raises(ConfigError, match="draft-eagle3"):
        DFlashDrafter.create(drafter_context(target, e3, SPEC))


def test_oracle_draft_is_fully_accepted(tmp_path: Path) -> None:
    """A block draft that proposes the anchor at every index, over a target that repeats its last token."""
    target_hf = tiny_hf.write_bigram_target(tmp_path / "rep", identity=True)
    f, _ = tiny_hf.bigram_map(target_hf)
    assert (f == np.arange(len(f))).all()
    target = tmp_path / "rep.gguf"
    convert(target_hf, target, outtype="f32")
    draft = tmp_path / "oracle.gguf"
    convert(tiny_hf.write_dflash_oracle(tmp_path / "oracle"), draft, outtype="f32", target_dir=target_hf)
    outs, refs, st = engine_vs_plain(target, draft, DFlashDrafter.create, SPEC, n_predict=20)
    assert outs == refs
    assert st["gen_tokens"] >= 3 * (st["gen_drafts"] - 2) and st["acc_tokens"] == st["gen_tokens"] > 0


@pytest.mark.slow
def test_smollm2_random_draft_is_lossless(tmp_path: Path) -> None:
    from model_drafter_helpers import random_draft_gguf, smollm2_or_skip

    target = smollm2_or_skip()
    draft = random_draft_gguf(tmp_path / "df.gguf", "dflash", target)
    outs, refs, st = engine_vs_plain(target, draft, DFlashDrafter.create, SPEC, n_predict=8)
    assert outs == refs and st["gen_drafts"] > 0


def test_drafts_made_in_the_engine_equal_a_from_scratch_reference(models: dict[str, Path]) -> None:
    """Every draft of a 2-slot engine run equals z-lab's DFlash recomputed from scratch over the committed
    history (block logits within 1e-4): injected context (prompt chunks, verification rows, rejected rows
    overwritten) is exactly what a fresh run would build."""
    import hf_reference as R
    import torch
    from model_drafter_helpers import (
        agree_unless_near_tie,
        assert_logits_close,
        block_logits,
        recorded_drafts,
    )

    log = recorded_drafts(models["target"], models["draft"], DFlashDrafter.create, SPEC, probe=block_logits)
    draft_hf = models["draft"].parent / "df-hf"
    checked = 0
    for history, last, tokens, probed in log:
        _, states = R.target_forward(models["hf"], history)
        feats = torch.cat([states[i] for i in (2, 7)], dim=-1)
        logits, _ = R.dflash_forward(draft_hf, models["hf"], feats, [last] + [tiny_hf.VOCAB - 1] * SPEC.n_max)
        assert_logits_close(probed, logits.numpy())
        checked += agree_unless_near_tie(tokens, [logits[j].numpy() for j in range(1, len(tokens) + 1)])
    assert len(log) > 10 and checked > 2 * len(log)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_random_draft_is_lossless_on_a_hybrid_target(tmp_path: Path, backend: str) -> None:
    """DFlash over a Qwen3.5 target: context features from delta-net and attention blocks, and the
    target's recurrent state rolled back under its block drafts."""
    from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path, tiny_qwen35_hf_path

    draft = tmp_path / "df.gguf"
    convert(tiny_hf.write_dflash(tmp_path / "df-hf", layer_ids=(0, 3), block_size=4), draft, outtype="f32",
            target_dir=tiny_qwen35_hf_path())
    outs, refs, st = engine_vs_plain(tiny_qwen35_gguf_path(), draft, DFlashDrafter.create, SPEC, backend=backend)
    assert outs == refs
    assert st["gen_drafts"] > 0
