"""training/eagle3_head.py: runtime parity of the exported head, the draft vocabulary, the training-time-test loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from spekula.backends.convert.hf import convert
from spekula.backends.torch.draft_common import target_embeddings
from spekula.core.backend import BackendOptions, ModelInfo
from spekula.core.drafting.draft_models import Eagle3Rows
from spekula.drafters.model.runtimes import load_draft_runtime
from spekula.fixtures import tiny_hf
from spekula.training.eagle3_head import (
    Eagle3Head,
    Eagle3HeadOptions,
    default_eagle3_layers,
    draft_vocabulary,
)
from spekula.training.export import write_hf_checkpoint
from spekula.training.head_api import TargetFacts, TrainBatch, read_target_facts

torch.set_num_threads(1)

TINY = TargetFacts(path="tiny.gguf", arch="llama", n_vocab=40, n_embd=16, n_layer=4, n_head=2, n_head_kv=1,
                   head_dim=8, n_ff=32, rope_theta=10000.0, rms_eps=1e-6, n_ctx_train=128)


def _tiny_head(seed: int = 0, **options: object) -> Eagle3Head:
    g = torch.Generator().manual_seed(100)
    embd = torch.randn(TINY.n_vocab, TINY.n_embd, generator=g)
    head = torch.randn(TINY.n_vocab, TINY.n_embd, generator=g)
    counts = np.arange(TINY.n_vocab)[::-1] % 7  # some ties and zeros
    return Eagle3Head.create(TINY, embd, head, counts, Eagle3HeadOptions(**options), seed)  # type: ignore[arg-type]


def _randomise(module: Eagle3Head, seed: int) -> None:
    """Weights large enough that attention is peaked and every path shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                gain = 3.0 if name in ("q_proj", "k_proj") else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / p.shape[1] ** 0.5)


def test_exported_head_matches_the_torch_runtime(tmp_path: Path) -> None:
    """Converted checkpoint run by backends/torch/eagle3.py (pending row + 3 chained steps, prenorm fed back)
    gives the module's step-0..3 logits at that row: layout, Q/K permutation, rope and the step masks agree."""
    hf = tiny_hf.write_target(tmp_path / "target", "llama", n_layer=4)
    target = tmp_path / "target.gguf"
    convert(hf, target, outtype="f32")
    facts = read_target_facts(str(target))
    embd, head = target_embeddings(str(target), torch.device("cpu"), torch.float32)
    counts = np.random.default_rng(0).integers(0, 50, facts.n_vocab)
    module = Eagle3Head.create(facts, embd, head, counts, Eagle3HeadOptions(draft_vocab=64), seed=3)
    _randomise(module, 4)
    folder = write_hf_checkpoint(module, tmp_path / "draft-hf")
    draft = tmp_path / "draft.gguf"
    convert(folder, draft, outtype="f32", target_dir=hf)
    info = ModelInfo(str(target), facts.arch, "target", facts.n_vocab, facts.n_embd, facts.n_layer, facts.n_ctx_train)
    runtime = load_draft_runtime("torch", str(draft), info, BackendOptions(n_ctx=64, n_seq_max=1, dtype="f32"))
    assert runtime.info.target_layers == module.layers == (2, 3, 4)

    rng = np.random.default_rng(1)
    T, steps = 16, 4
    tokens = rng.integers(0, facts.n_vocab, (2, T))
    features = rng.standard_normal((2, T, 3 * facts.n_embd)).astype(np.float32)
    valid = np.ones((2, T), dtype=bool)
    valid[1, 10:] = False  # a padded second sequence in the batch changes nothing for the first
    with torch.no_grad():
        states = module.draft_states(torch.from_numpy(tokens), torch.from_numpy(features),
                                     torch.from_numpy(valid), n_steps=steps)
    ids = module.draft_ids.numpy()
    outside = ~module.t2d.numpy()
    seq = runtime.new_seq()
    for pos in (0, 4, T - steps - 1):
        runtime.truncate(seq, 0)
        g = runtime.encode(features[0, : pos + 1])
        if pos:
            runtime.decode([Eagle3Rows(seq, tokens[0, 1:pos + 1].astype(np.int32), g[:pos], 0, False)])
        hidden = g[pos:pos + 1]
        for k in range(steps):
            (out,) = runtime.decode([Eagle3Rows(seq, tokens[0, pos + 1 + k: pos + 2 + k].astype(np.int32), hidden,
                                                pos + k)])
            assert out.logits is not None
            mine = module.draft_logits(states[k][0, pos]).detach().numpy()
            assert np.isneginf(out.logits[0, outside]).all()
            np.testing.assert_allclose(out.logits[0, ids], mine, atol=1e-4, rtol=0, err_msg=f"pos {pos} step {k}")
            np.testing.assert_allclose(out.prenorm[0], states[k][0, pos].numpy(), atol=1e-4, rtol=1e-5)
            hidden = out.prenorm[-1:]


def test_draft_vocabulary_from_counts() -> None:
    counts = np.array([3, 0, 9, 3, 0, 5, 3, 0], dtype=np.int64)
    np.testing.assert_array_equal(draft_vocabulary(counts, 4), [0, 2, 3, 5])  # 3-count tie: ids 0, 3 before 6
    np.testing.assert_array_equal(draft_vocabulary(counts, 7), [0, 1, 2, 3, 4, 5, 6])  # zero counts by lower id
    g = torch.Generator().manual_seed(0)
    embd, head = torch.randn(TINY.n_vocab, 16, generator=g), torch.randn(TINY.n_vocab, 16, generator=g)
    counts = np.zeros(TINY.n_vocab, dtype=np.int64)
    counts[[7, 30, 2, 11]] = [5, 9, 1, 5]
    m = Eagle3Head.create(TINY, embd, head, counts, Eagle3HeadOptions(draft_vocab=6), seed=0)
    ids = [0, 2, 7, 11, 30, 1]  # 30 (9), 7 and 11 (5), 2 (1), then the zero counts 0 and 1
    assert sorted(ids) == m.draft_ids.tolist()
    _, t = m.hf_checkpoint()
    np.testing.assert_array_equal(t["d2t"], np.array(sorted(ids)) - np.arange(6))
    assert t["d2t"].dtype == np.int64 and t["t2d"].dtype == np.bool_
    np.testing.assert_array_equal(np.flatnonzero(t["t2d"]), sorted(ids))
    np.testing.assert_array_equal(t["lm_head.weight"], head[sorted(ids)].numpy())
    capped = Eagle3Head.create(TINY, embd, head, counts, Eagle3HeadOptions(draft_vocab=10_000), seed=0)
    assert capped.lm_head.shape[0] == TINY.n_vocab and capped.t2d.all() and not capped.d2t.any()


def test_default_layers() -> None:
    assert default_eagle3_layers(32) == (2, 16, 29)
    assert default_eagle3_layers(8) == (2, 4, 5)
    assert default_eagle3_layers(4) == (2, 3, 4)
    assert default_eagle3_layers(3) == (1, 2, 3)
    assert default_eagle3_layers(2) == (0, 1, 2)
    with pytest.raises(ValueError):
        default_eagle3_layers(1)
    with pytest.raises(ValueError, match="distinct"):
        _tiny_head(layers=(1, 1, 2))


def _batch(seed: int = 5) -> TrainBatch:
    rng = np.random.default_rng(seed)
    B, T = 3, 12
    tokens = rng.integers(0, TINY.n_vocab, (B, T))
    labels = rng.integers(0, TINY.n_vocab, (B, T))
    valid = np.ones((B, T), dtype=bool)
    valid[2, 8:] = False
    labels[~valid] = -1
    loss_mask = valid.copy()
    loss_mask[:, :3] = False  # the prompt
    features = rng.standard_normal((B, T, 3 * TINY.n_embd)).astype(np.float32)
    return TrainBatch(torch.from_numpy(tokens), torch.from_numpy(labels), torch.from_numpy(features),
                      torch.from_numpy(valid), torch.from_numpy(loss_mask))


def _expected_counts(m: Eagle3Head, batch: TrainBatch) -> tuple[list[float], list[float]]:
    """Counts and argmax hits per step, spelled out row by row from draft_states."""
    B, T = batch.tokens.shape
    with torch.no_grad():
        states = m.draft_states(batch.tokens, batch.features, batch.valid)
    in_vocab = set(m.draft_ids.tolist())
    correct, count = [0.0] * m.ttt_steps, [0.0] * m.ttt_steps
    for k, h in enumerate(states):
        for b in range(B):
            for t in range(T - 1 - k):
                label = int(batch.labels[b, t + 1 + k])
                if not (batch.valid[b, t:t + 2 + k].all() and batch.loss_mask[b, t + 1 + k] and label in in_vocab):
                    continue
                count[k] += 1
                guess = int(m.draft_ids[int(m.draft_logits(h[b, t]).argmax())])
                correct[k] += float(guess == label)
    return correct, count


def test_training_lowers_the_loss_and_counts_are_consistent() -> None:
    m = _tiny_head(draft_vocab=24)
    batch = _batch()
    gen = torch.Generator().manual_seed(0)
    first, metrics = m.loss(batch, gen)
    correct, count = _expected_counts(m, batch)
    assert metrics.count == count and metrics.correct == correct
    assert all(c > 0 for c in count) and count == sorted(count, reverse=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(40):
        opt.zero_grad()
        loss, _ = m.loss(batch, gen)
        loss.backward()
        opt.step()
    last, metrics = m.loss(batch, gen)
    assert last.item() < 0.5 * first.item()
    assert (metrics.correct, metrics.count) == _expected_counts(m, batch)
    assert metrics.correct[0] > correct[0]
    assert m.embd.grad is None and "embd" not in dict(m.named_parameters())


def test_loss_is_deterministic_and_export_round_trips() -> None:
    m = _tiny_head()
    batch = _batch()
    a, ma = m.loss(batch, torch.Generator().manual_seed(1))
    b, mb = m.loss(batch, torch.Generator().manual_seed(1))
    assert a.item() == b.item() and ma == mb
    again = _tiny_head()
    assert all(torch.equal(x, y) for x, y in zip(m.state_dict().values(), again.state_dict().values(), strict=True))
    assert not torch.equal(_tiny_head(seed=1).fc, m.fc)
    assert "embd" not in m.state_dict()  # the frozen target embedding is never saved or exported
    config, tensors = m.hf_checkpoint()
    assert "embed_tokens.weight" not in tensors and config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    rebuilt = Eagle3Head.from_hf(config, tensors, m.embd, TINY)
    c, _ = rebuilt.loss(batch, torch.Generator())
    assert c.item() == a.item()
