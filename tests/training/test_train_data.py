"""Self-distillation data: the built-in prompt set, the feature cache on disk, the distiller."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spekula.core.backend import BackendOptions, Capture, SeqInput, load_backend
from spekula.core.errors import ConfigError
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.training.distill import Distiller, DistillOptions, distill
from spekula.training.feature_cache import CacheError, DistilledSequence, FeatureCache, FeatureCacheWriter
from spekula.training.prompts import builtin_prompts, read_prompt_file

LAYERS = (1, 2, 4)


@pytest.fixture(scope="module")
def target() -> str:
    return str(tiny_model_path("llama"))


def test_builtin_prompts_are_deterministic_distinct_and_split() -> None:
    train = builtin_prompts(300, seed=0)
    assert train == builtin_prompts(300, seed=0)
    assert len(set(train)) == 300
    assert builtin_prompts(300, seed=1) != train
    held = builtin_prompts(60, seed=0, split="heldout")
    assert not set(held) & set(builtin_prompts(1500, seed=0))
    assert any("```python" in p for p in train) and any("```python" not in p for p in train)
    with pytest.raises(ConfigError, match="fewer than"):
        builtin_prompts(10**6)


def test_prompt_files(tmp_path: Path) -> None:
    lines = tmp_path / "a.txt"
    lines.write_text("first prompt\n\nsecond prompt\n")
    assert read_prompt_file(lines) == ["first prompt", "second prompt"]
    js = tmp_path / "b.json"
    js.write_text(json.dumps(["x\ny", "z"]))
    assert read_prompt_file(js) == ["x\ny", "z"]
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"prompt": "p1"}\n{"prompt": "p2"}\n')
    assert read_prompt_file(jl) == ["p1", "p2"]
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(ConfigError, match="prompt"):
        read_prompt_file(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        read_prompt_file(tmp_path / "missing.txt")


def test_distilled_rows_are_the_targets_own_forward(target: str) -> None:
    """Features and labels equal what one plain forward of the whole sequence gives; answers are greedy."""
    d = Distiller(target, LAYERS, DistillOptions(max_new=12, parallel=3, n_ctx=1024))
    prompts = builtin_prompts(5)
    seqs = d.answer(list(enumerate(prompts)))
    d.close()
    assert len(seqs) == 5
    be = load_backend("native", target, BackendOptions(n_ctx=1024, n_seq_max=1))
    for s, p in zip(seqs, prompts, strict=True):
        assert s.answer_start == len(d.encode(p)) and len(s.tokens) > s.answer_start
        # greedy: every answer token is the label of the row before it
        assert np.array_equal(s.tokens[s.answer_start:], s.labels[s.answer_start - 1:-1])
        seq = be.new_seq()
        out = be.forward([SeqInput(seq, s.tokens, 0, logit_rows=np.arange(len(s.tokens)))],
                         Capture(layers=frozenset(LAYERS)))[0]
        be.free_seq(seq)
        assert np.array_equal(np.argmax(out.logits, axis=1), s.labels)
        want = np.concatenate([out.layer_inputs[x] for x in LAYERS], axis=1).astype(np.float16)
        np.testing.assert_allclose(s.features.astype(np.float32), want.astype(np.float32), rtol=1e-3, atol=1e-3)
    be.close()


def test_distill_does_not_depend_on_batching_and_resumes(target: str, tmp_path: Path) -> None:
    prompts = builtin_prompts(12)
    a = distill(target, prompts, LAYERS, tmp_path / "a", 10**9, DistillOptions(max_new=10, parallel=1, n_ctx=1024,
                                                                              shard_prompts=5))
    # the same recipe in two sittings with another batch size: the first stops after one shard
    b1 = distill(target, prompts, LAYERS, tmp_path / "b", 1, DistillOptions(max_new=10, parallel=4, n_ctx=1024,
                                                                           shard_prompts=5))
    assert len(b1) == 5
    b = distill(target, prompts, LAYERS, tmp_path / "b", 10**9, DistillOptions(max_new=10, parallel=4, n_ctx=1024,
                                                                              shard_prompts=5))
    assert len(a) == len(b) == 12 and b.exhausted
    for i in range(12):
        assert np.array_equal(a[i].tokens, b[i].tokens) and np.array_equal(a[i].labels, b[i].labels)
        assert np.array_equal(np.asarray(a[i].features), np.asarray(b[i].features))
    # a second run finds the data and computes nothing
    again = distill(target, prompts, LAYERS, tmp_path / "a", 10**9, DistillOptions(max_new=10, parallel=2, n_ctx=1024,
                                                                                  shard_prompts=5))
    assert again.n_tokens == a.n_tokens
    # another recipe in the same folder is refused
    with pytest.raises(CacheError, match="another recipe"):
        distill(target, prompts, LAYERS, tmp_path / "a", 10**9, DistillOptions(max_new=11, n_ctx=1024))


def _seq(n: int, width: int, seed: int) -> DistilledSequence:
    r = np.random.default_rng(seed)
    return DistilledSequence(r.integers(0, 50, n).astype(np.int32), r.integers(0, 50, n).astype(np.int32),
                             r.standard_normal((n, width)).astype(np.float16), 2)


def test_damaged_cache_is_an_error_naming_the_file(tmp_path: Path) -> None:
    w = FeatureCacheWriter(tmp_path, {"r": 1}, 8)
    w.write_shard([_seq(5, 8, 0), _seq(7, 8, 1)], n_prompts=2)
    w.write_shard([_seq(3, 8, 2)], n_prompts=1)
    c = FeatureCache(tmp_path)
    assert len(c) == 3 and c.n_tokens == 15 and c.label_counts(50).sum() == 15
    feats = tmp_path / "shard-00001.features.npy"
    raw = bytearray(feats.read_bytes())
    raw[-1] ^= 0xFF
    feats.write_bytes(bytes(raw))
    with pytest.raises(CacheError, match="shard-00001.features.npy"):
        FeatureCache(tmp_path)
    with pytest.raises(CacheError, match="damaged"):
        FeatureCacheWriter(tmp_path, {"r": 1}, 8)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CacheError, match="manifest"):
        FeatureCache(tmp_path)


def test_a_failed_shard_write_keeps_the_cache_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FeatureCacheWriter(tmp_path, {"r": 1}, 8)
    w.write_shard([_seq(5, 8, 0)], n_prompts=1)

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", full_disk)
    with pytest.raises(OSError, match="No space"):
        w.write_shard([_seq(4, 8, 1)], n_prompts=1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard-00000.features.npy", "shard-00000.npz"]
    c = FeatureCache(tmp_path)
    assert len(c) == 1 and c.n_tokens == 5
