"""Soft labels: the target's top-K next tokens kept by distillation and learned by both head kinds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_drafter_helpers import engine_vs_plain

from spekula.core.backend import BackendOptions, Capture, SeqInput, load_backend
from spekula.core.errors import ConfigError
from spekula.core.params import SpecParams
from spekula.drafters.model.dflash import DFlashDrafter
from spekula.drafters.model.eagle3 import Eagle3Drafter
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.cli.main import main
from spekula.training.distill import Distiller, DistillOptions, distill, recipe_for, top_k_log_probs
from spekula.training.feature_cache import FeatureCache
from spekula.training.head_api import soft_cross_entropy
from spekula.training.prompts import builtin_prompts
from spekula.training.run import quick_request, run_training

LAYERS = (1, 2, 4)
MAKERS = {"eagle3": Eagle3Drafter.create, "dflash": DFlashDrafter.create}


# torch on one thread (tests/conftest.py); `bigram` is the learnable tiny target from there too.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_soft_cross_entropy_renormalises_over_present_entries() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=gen)
    # A one-hot top-K (every other entry at -inf) is the hard cross-entropy.
    ids = torch.tensor([[3, 1, 0]] * 5)
    onehot = torch.tensor([[0.0, float("-inf"), float("-inf")]] * 5)
    torch.testing.assert_close(soft_cross_entropy(logits, ids, onehot), F.cross_entropy(logits, ids[:, 0], reduction="none"))
    # With the whole vocabulary it is the cross-entropy against the target's softmax.
    target = torch.randn(5, 11, generator=gen)
    all_ids = torch.arange(11).expand(5, 11)
    want = -(torch.softmax(target, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(logits, all_ids, torch.log_softmax(target, -1)), want)
    # Absent entries (-1) drop out and the rest is renormalised, whatever their log-probabilities say.
    ids = torch.tensor([[2, -1, 4]])
    logp = torch.log(torch.tensor([[0.3, 0.5, 0.1]]))
    got = soft_cross_entropy(logits[:1], ids, logp)
    lsm = torch.log_softmax(logits[:1], -1)[0]
    torch.testing.assert_close(got, -(0.75 * lsm[2] + 0.25 * lsm[4]).reshape(1))


def test_top_k_is_ordered_and_starts_with_the_argmax() -> None:
    r = np.random.default_rng(0)
    logits = r.standard_normal((6, 40)).astype(np.float32)
    logits[2] = 0.0
    logits[2, [9, 5]] = 3.0  # a tie for the top: the lower id wins, as np.argmax picks it
    ids, logp = top_k_log_probs(logits, 8)
    assert ids.shape == logp.shape == (6, 8) and ids.dtype == np.int32 and logp.dtype == np.float16
    assert np.array_equal(ids[:, 0], np.argmax(logits, axis=1))
    assert list(ids[2, :2]) == [5, 9]
    assert np.all(np.diff(logp.astype(np.float32), axis=1) <= 0)
    full = torch.log_softmax(torch.from_numpy(logits), -1).numpy()
    np.testing.assert_allclose(logp.astype(np.float32), np.take_along_axis(full, ids, 1), atol=2e-2)
    assert top_k_log_probs(logits, 100)[0].shape == (6, 40)  # K past the vocabulary: all of it


def test_distilled_soft_labels_are_the_targets_own_top_k(tmp_path: Path) -> None:
    target = str(tiny_model_path("llama"))
    prompts = builtin_prompts(4)
    hard = DistillOptions(max_new=8, parallel=2, n_ctx=1024)
    soft = DistillOptions(max_new=8, parallel=2, n_ctx=1024, soft_top_k=6)
    # Caches distilled before soft labels existed keep their recipe; a top-K is part of a new one.
    assert "soft_top_k" not in recipe_for(target, prompts, LAYERS, hard)["generation"]  # type: ignore[operator]
    assert recipe_for(target, prompts, LAYERS, soft)["generation"]["soft_top_k"] == 6  # type: ignore[index]

    cache = distill(target, prompts, LAYERS, tmp_path / "soft", 10**9, soft)
    plain = distill(target, prompts, LAYERS, tmp_path / "hard", 10**9, hard)
    assert cache.has_soft_labels and not plain.has_soft_labels and len(cache) == len(plain) == 4
    be = load_backend("native", target, BackendOptions(n_ctx=1024, n_seq_max=1))
    for i in range(len(cache)):
        s, h = cache[i], plain[i]
        assert np.array_equal(s.tokens, h.tokens) and np.array_equal(s.labels, h.labels)  # same data otherwise
        assert s.soft_ids is not None and s.soft_logp is not None and s.soft_ids.shape == (len(s.tokens), 6)
        assert np.array_equal(s.soft_ids[:, 0], s.labels)
        seq = be.new_seq()
        out = be.forward([SeqInput(seq, s.tokens, 0, logit_rows=np.arange(len(s.tokens)))], Capture())[0]
        be.free_seq(seq)
        full = torch.log_softmax(torch.from_numpy(out.logits.astype(np.float32)), -1).numpy()
        np.testing.assert_allclose(s.soft_logp.astype(np.float32), np.take_along_axis(full, s.soft_ids, 1), atol=2e-2)
    be.close()
    reopened = FeatureCache(tmp_path / "soft")
    assert reopened.has_soft_labels and np.array_equal(reopened[1].soft_ids, cache[1].soft_ids)  # type: ignore[arg-type]
    assert Distiller  # the distiller's own batching is covered by test_train_data.py


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_quick_training_on_soft_labels_learns_and_runs_losslessly(kind: str, bigram: Path, tmp_path: Path) -> None:
    base = quick_request(kind, str(bigram), tmp_path / "hard", cache_dir=tmp_path / "cache-hard", outtype="f32")
    soft_distill = DistillOptions(**{**{f: getattr(base.distill, f) for f in base.distill.__slots__}, "soft_top_k": 8})
    req = quick_request(kind, str(bigram), tmp_path / "soft", cache_dir=tmp_path / "cache-soft", outtype="f32",
                        distill=soft_distill)
    out = run_training(req)
    assert out.summary["config"]["soft_labels"] is True and out.gguf is not None
    hist = out.result.history
    first = sum(h["loss"] for h in hist[:5]) / 5
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    # The same run on hard labels (same tokens, same batches) ends on other weights: the soft loss ran.
    hard = run_training(base)
    assert "soft_labels" not in hard.summary["config"]
    a, b = hard.result.head.state_dict(), out.result.head.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    spec = SpecParams(types=(f"draft-{kind}",), n_max=3, adaptive=False)
    outs, refs, st = engine_vs_plain(bigram, out.gguf, MAKERS[kind], spec, n_predict=16)
    assert outs == refs and st["gen_drafts"] > 0 and st["acc_tokens"] > 0


def test_soft_labels_need_a_cache_that_keeps_them(bigram: Path, tmp_path: Path) -> None:
    from spekula.training.feature_cache import FeatureCache as Cache
    from spekula.training.head_api import read_target_facts
    from spekula.training.loop import train
    from spekula.training.run_config import RunConfig

    req = quick_request("eagle3", str(bigram), tmp_path / "run", cache_dir=tmp_path / "cache", steps=1)
    run_training(req)
    cache = Cache(tmp_path / "cache")
    cfg = RunConfig(kind="eagle3", steps=1, seed=0, batch_seqs=4, seq_len=128, n_eval=4,
                    head={**req.head, "layers": list(cache.recipe["layers"])}, soft_labels=True)
    with pytest.raises(ConfigError, match="--soft-top-k"):
        train(cfg, read_target_facts(str(bigram)), cache, list(cache.recipe["layers"]), tmp_path / "other",
              resume=False)


def test_cli_soft_top_k(bigram: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    rc = main(["train-drafter", "eagle3", "-m", str(bigram), "-o", str(out), "--quick", "--soft-top-k", "4",
               "--steps", "4", "--cache-dir", str(tmp_path / "c")])
    assert rc == 0
    summary = json.loads((out / "train.json").read_text())
    assert summary["config"]["soft_labels"] is True and summary["data"]["recipe"]["generation"]["soft_top_k"] == 4
    rc = main(["train-drafter", "eagle3", "-m", str(bigram), "-o", str(tmp_path / "bad"), "--quick",
               "--soft-top-k", "-1"])
    assert rc != 0 and "--soft-top-k" in capsys.readouterr().err
