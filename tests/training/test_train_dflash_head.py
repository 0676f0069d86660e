"""The trainable DFlash head: its forward is the converted draft's, its loss trains, and anchors stay inside."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from spekula.backends.convert.hf import convert
from spekula.backends.torch.draft_common import target_embeddings
from spekula.core.backend import BackendOptions, ModelInfo
from spekula.core.drafting.draft_models import DFlashBlock, DFlashRuntime
from spekula.core.errors import ConfigError, ModelFileError
from spekula.drafters.model.runtimes import load_draft_runtime
from spekula.fixtures import tiny_hf
from spekula.training.dflash_head import (
    DFlashHead,
    DFlashHeadOptions,
    choose_mask_token,
    default_dflash_layers,
    mask_token_for,
)
from spekula.training.eagle3_head import default_eagle3_layers
from spekula.training.export import write_hf_checkpoint
from spekula.training.head_api import TargetFacts, TrainBatch, read_target_facts

BLOCK = 4


# Tiny tensors: threads only contend (with each other and the rest of the machine).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF folder, f32 GGUF) of a 4-layer tiny llama target."""
    root = tmp_path_factory.mktemp("train-dflash")
    hf = tiny_hf.write_target(root / "target", "llama", n_layer=4)
    gguf = root / "target.gguf"
    convert(hf, gguf, outtype="f32")
    return hf, gguf


def _scramble(head: DFlashHead, seed: int) -> None:
    """Weights large enough that attention and MLP move the logits (a fresh head is nearly the identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)


def _synthetic_head(**options: object) -> DFlashHead:
    facts = TargetFacts("synthetic.gguf", "llama", n_vocab=320, n_embd=64, n_layer=4, n_head=4, n_head_kv=2,
                        head_dim=16, n_ff=128, rope_theta=10000.0, rms_eps=1e-6, n_ctx_train=2048)
    gen = torch.Generator().manual_seed(7)
    embd, head = torch.randn(320, 64, generator=gen), torch.randn(320, 64, generator=gen) / 8
    opts = DFlashHeadOptions(**{"block_size": BLOCK, "mask_token_id": 319, "anchors_per_seq": 6, **options})  # type: ignore[arg-type]
    return DFlashHead.create(facts, embd, head, opts, seed=3)


def _batch(lengths: tuple[int, ...], T: int, seed: int = 0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    valid = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    tokens = torch.randint(3, 300, (B, T), generator=gen).masked_fill(~valid, 0)
    labels = torch.randint(3, 300, (B, T), generator=gen).masked_fill(~valid, -1)
    loss_mask = valid & (torch.arange(T)[None, :] >= 2)  # the first two positions are "prompt"
    features = torch.randn(B, T, 3 * 64, generator=gen)
    return TrainBatch(tokens, labels, features, valid, loss_mask)


def test_forward_equals_the_converted_draft_runtime(target: tuple[Path, Path], tmp_path: Path) -> None:
    hf, gguf = target
    facts = read_target_facts(str(gguf))
    embd, out_head = target_embeddings(str(gguf), torch.device("cpu"), torch.float32)
    head = DFlashHead.create(facts, embd, out_head, DFlashHeadOptions(block_size=BLOCK, mask_token_id=318), seed=0)
    assert head.layers == default_dflash_layers(4) == (2, 3, 4)
    _scramble(head, 1)
    folder = write_hf_checkpoint(head, tmp_path / "draft-hf")
    draft = tmp_path / "draft.gguf"
    convert(folder, draft, outtype="f32", target_dir=hf)

    info = ModelInfo(str(gguf), facts.arch, "target", facts.n_vocab, facts.n_embd, facts.n_layer, facts.n_ctx_train)
    runtime = load_draft_runtime("torch", str(draft), info, BackendOptions(n_ctx=64, n_seq_max=1))
    assert isinstance(runtime, DFlashRuntime) and runtime.info.target_layers == head.layers
    batch = _batch((14, 11), 14, seed=2)
    anchors = torch.tensor([[1, 6, 12], [3, 9, 10]])
    with torch.no_grad():
        ours = head(batch.features, batch.tokens, anchors).numpy()
    seq = runtime.new_seq()
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            runtime.inject(seq, batch.features[b, :a].numpy(), 0)
            block = np.array([int(batch.tokens[b, a])] + [318] * (BLOCK - 1), dtype=np.int32)
            (out,) = runtime.draft_blocks([DFlashBlock(seq, block, a)])
            np.testing.assert_allclose(ours[b, i, 1:], out.logits[1:], atol=1e-4, rtol=0)
            runtime.truncate(seq, 0)
    assert np.abs(ours[:, :, 1:] - ours[:, :, :1]).max() > 1.0  # the block rows really differ

    again = DFlashHead.from_hf(*head.hf_checkpoint(), embd, out_head, facts)
    with torch.no_grad():
        np.testing.assert_array_equal(again(batch.features, batch.tokens, anchors).numpy(), ours)


def test_mask_token_is_an_unseen_control_or_unused_id(target: tuple[Path, Path]) -> None:
    _, gguf = target
    counts = np.zeros(320, dtype=np.int64)
    counts[3:300] = 5
    assert mask_token_for(str(gguf), counts) == 2  # <|im_end|>, the highest control id, never occurs
    counts[:3] = 1
    assert mask_token_for(str(gguf), counts) == 319  # then the highest padding ([PAD]) id
    counts[319] = 1
    assert mask_token_for(str(gguf), counts) == 318
    assert choose_mask_token([3, 1, 1], np.array([1, 0, 0, 0])) == 3  # a row past the token list is unused
    with pytest.raises(ConfigError, match="mask token"):
        choose_mask_token([3, 1, 5], np.array([1, 0, 2]))


def test_default_layers_are_the_eagle3_ones_where_dflash_can_read_them() -> None:
    assert default_dflash_layers(1) == (1,)
    assert default_dflash_layers(2) == (1, 2)
    assert default_dflash_layers(32) == (2, 16, 29)
    for n in range(3, 40):
        ids = default_dflash_layers(n)
        assert ids == default_eagle3_layers(n)
        assert list(ids) == sorted(set(ids)) and all(1 <= x <= n for x in ids) and len(ids) == 3


def test_a_few_adamw_steps_lower_the_loss() -> None:
    torch.manual_seed(0)
    head = _synthetic_head()
    batch = _batch((20, 16), 20)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        loss, _ = head.loss(batch, torch.Generator().manual_seed(11))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
    assert head.target_embd.grad is None and "target_embd" not in head.state_dict()


def test_loss_is_deterministic_and_never_reads_past_a_sequence() -> None:
    head = _synthetic_head(anchors_per_seq=64)  # more than any sequence has: every candidate anchor
    batch = _batch((12, 5), 12)
    loss, metrics = head.loss(batch, torch.Generator().manual_seed(4))
    loss2, metrics2 = head.loss(batch, torch.Generator().manual_seed(4))
    assert loss.item() == loss2.item() and metrics == metrics2
    # Every anchor a >= 1 with a counted label among a .. a + BLOCK - 2 counts each such label once.
    expected = [0.0] * (BLOCK - 1)
    for length in (12, 5):
        for a in range(1, length):
            for j in range(1, BLOCK):
                if a + j - 1 < length and a + j - 1 >= 2:
                    expected[j - 1] += 1
    assert metrics.count == expected

    garbage = TrainBatch(batch.tokens.clone(), batch.labels.clone(), batch.features.clone(), batch.valid,
                         batch.loss_mask)
    pad = ~batch.valid
    garbage.labels[pad] = 10**6  # an out-of-vocabulary label would fail cross-entropy if it were read
    garbage.tokens[pad] = 10**6
    garbage.features[pad] = float("nan")
    garbage.labels[~batch.loss_mask & batch.valid] = 10**6
    loss3, metrics3 = head.loss(garbage, torch.Generator().manual_seed(4))
    assert loss3.item() == loss.item() and metrics3 == metrics

    # The loss is the pos_decay-weighted mean cross-entropy of exactly those predictions.
    anchors, used = head.sample_anchors(batch, torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = head(batch.features, batch.tokens, anchors)
    total, weights = 0.0, 0.0
    for b, length in enumerate((12, 5)):
        for k in range(anchors.shape[1]):
            a = int(anchors[b, k])
            for j in range(1, BLOCK):
                if used[b, k] and 2 <= a + j - 1 < length:
                    w = 0.8 ** (j - 1)
                    total += w * float(torch.nn.functional.cross_entropy(logits[b, k, j], batch.labels[b, a + j - 1]))
                    weights += w
    assert loss.item() == pytest.approx(total / weights, rel=1e-5)

    few = _synthetic_head(anchors_per_seq=2)
    picks = set()
    for seed in range(8):
        anchors, used = few.sample_anchors(batch, torch.Generator().manual_seed(seed))
        assert used.all() and ((anchors >= 1) & (anchors < torch.tensor([[12], [5]]))).all()
        assert (anchors[:, 0] != anchors[:, 1]).all()
        picks.add(tuple(anchors.flatten().tolist()))
    assert len(picks) > 1


def test_a_draft_vocabulary_exports_the_target_heads_rows(target: tuple[Path, Path], tmp_path: Path) -> None:
    """draft_vocab keeps the target head's rows of the most frequent labels: the converted head drafts
    over them with the logits the whole head gives those ids, and the checkpoint reads back."""
    hf, gguf = target
    facts = read_target_facts(str(gguf))
    embd, out_head = target_embeddings(str(gguf), torch.device("cpu"), torch.float32)
    counts = np.zeros(facts.n_vocab, dtype=np.int64)
    counts[[5, 17, 40, 200, 201, 300]] = [9, 3, 7, 1, 2, 8]
    opts = DFlashHeadOptions(block_size=BLOCK, mask_token_id=318, draft_vocab=8)
    head = DFlashHead.create(facts, embd, out_head, opts, seed=0, label_counts=counts)
    # the six counted ids, then the two lowest ids of the zero-count ties
    assert head.draft_ids is not None and head.draft_ids.tolist() == [0, 1, 5, 17, 40, 200, 201, 300]
    _scramble(head, 2)
    config, tensors = head.hf_checkpoint()
    assert config["draft_vocab_size"] == 8 and tensors["lm_head.weight"].shape == (8, facts.n_embd)
    draft = tmp_path / "draft.gguf"
    convert(write_hf_checkpoint(head, tmp_path / "draft-hf"), draft, outtype="f32", target_dir=hf)
    info = ModelInfo(str(gguf), facts.arch, "target", facts.n_vocab, facts.n_embd, facts.n_layer, facts.n_ctx_train)
    runtime = load_draft_runtime("torch", str(draft), info, BackendOptions(n_ctx=64, n_seq_max=1))
    batch = _batch((14,), 14, seed=3)
    with torch.no_grad():
        ours = head(batch.features, batch.tokens, torch.tensor([[6]])).numpy()[0, 0]
    seq = runtime.new_seq()
    runtime.inject(seq, batch.features[0, :6].numpy(), 0)
    (out,) = runtime.draft_blocks([DFlashBlock(seq, np.array([int(batch.tokens[0, 6])] + [318] * (BLOCK - 1),
                                                                dtype=np.int32), 6)])
    got = out.logits if out.vocab is not None else out.logits[:, head.draft_ids]
    np.testing.assert_allclose(got[1:], ours[1:, head.draft_ids], atol=1e-4, rtol=0)

    again = DFlashHead.from_hf(config, tensors, embd, out_head, facts)
    assert again.draft_ids is not None and again.draft_ids.tolist() == head.draft_ids.tolist()
    assert again.options.draft_vocab == 8
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    with pytest.raises(ModelFileError, match="target head's rows"):
        DFlashHead.from_hf(config, tensors, embd, out_head, facts)
    with pytest.raises(ConfigError, match="label counts"):
        DFlashHead.create(facts, embd, out_head, opts, seed=0)
    whole = DFlashHead.create(facts, embd, out_head, replace(opts, draft_vocab=facts.n_vocab), seed=0)
    assert whole.draft_ids is None and "d2t" not in whole.hf_checkpoint()[1]
