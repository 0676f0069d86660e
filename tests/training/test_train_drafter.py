"""`spekula train-drafter`: quick runs on a tiny target learn, resume bit-identically, export runnable heads."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import model_drafter_helpers
import pytest
import torch
from model_drafter_helpers import engine_vs_plain

from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import SpecParams
from spekula.drafters.model.dflash import DFlashDrafter
from spekula.drafters.model.eagle3 import Eagle3Drafter
from spekula.frontends.cli.main import main
from spekula.training import checkpoint as ckpt_mod
from spekula.training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from spekula.training.export import export_gguf, write_hf_checkpoint
from spekula.training.feature_cache import CacheError
from spekula.training.head_api import read_target_facts
from spekula.training.head_factory import build_head
from spekula.training.loop import StepReport
from spekula.training.prompts import builtin_prompts
from spekula.training.run import TrainRequest, quick_request, run_training
from spekula.training.run_config import RunConfig

MAKERS = {"eagle3": Eagle3Drafter.create, "dflash": DFlashDrafter.create}


# torch on one thread (tests/conftest.py); `bigram` is the learnable tiny target from there too.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("feature-cache")


def _quick(kind: str, target: Path, out: Path, cache: Path, **over: object) -> TrainRequest:
    return quick_request(kind, str(target), out, **{"cache_dir": cache / kind, **over})


def _untrained_gguf(req: TrainRequest, out: Path) -> Path:
    """The head as initialised, before any step, exported like a trained one."""
    from spekula.training.feature_cache import FeatureCache

    facts = read_target_facts(req.target)
    trained_cfg = load_checkpoint(req.out_dir)["config"]
    cfg = RunConfig(**trained_cfg)
    head = build_head(cfg, facts, FeatureCache(req.cache_dir), torch.device("cpu"))  # type: ignore[arg-type]
    return export_gguf(write_hf_checkpoint(head, out / "hf"), req.target, out / "untrained.gguf", "f32")


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_quick_training_learns_and_the_head_runs_losslessly(kind: str, bigram: Path, cache_dir: Path,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    req = _quick(kind, bigram, tmp_path / "run", cache_dir, outtype="f32")
    out = run_training(req)
    assert not out.result.interrupted and out.gguf is not None and out.gguf.is_file()
    hist = out.result.history
    assert len(hist) == req.steps
    first = sum(h["loss"] for h in hist[:5]) / 5
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    summary = json.loads((req.out_dir / "train.json").read_text())
    assert summary["steps_done"] == req.steps and summary["data"]["tokens"] >= req.tokens
    assert (req.out_dir / "hf" / "config.json").is_file()

    # Real acceptance in the engine on held-out chat prompts, trained against untrained, both lossless.
    tok = Tokenizer.from_gguf(GGUFFile(bigram))
    chats = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in builtin_prompts(2, split="heldout")]
    monkeypatch.setattr(model_drafter_helpers, "PROMPTS", chats)
    spec = SpecParams(types=(f"draft-{kind}",), n_max=3, adaptive=False)
    untrained = _untrained_gguf(req, tmp_path / "untrained")
    outs, refs, trained_st = engine_vs_plain(bigram, out.gguf, MAKERS[kind], spec, n_predict=24)
    assert outs == refs
    outs0, refs0, untrained_st = engine_vs_plain(bigram, untrained, MAKERS[kind], spec, n_predict=24)
    assert outs0 == refs0

    def rate(st: dict[str, float]) -> float:
        return st["acc_tokens"] / max(1, st["gen_tokens"])

    assert rate(trained_st) >= rate(untrained_st) + 0.2, (trained_st, untrained_st)


def test_resume_continues_bit_identically(bigram: Path, cache_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    straight = run_training(_quick("eagle3", bigram, tmp_path / "straight", cache_dir, steps=16))

    # The same run, Ctrl-C after step 7: the loop stops at a step boundary and checkpoints.
    def interrupt_at_7(report: StepReport) -> None:
        if report.step == 7:
            os.kill(os.getpid(), signal.SIGINT)

    req = _quick("eagle3", bigram, tmp_path / "split", cache_dir, steps=16)
    first = run_training(req, on_step=interrupt_at_7)
    assert first.result.interrupted and first.result.steps_done == 7 and first.gguf is None
    assert load_checkpoint(req.out_dir)["step"] == 7
    with pytest.raises(ConfigError, match="--resume"):
        run_training(req)
    with pytest.raises(ConfigError, match="other settings"):
        run_training(replace(req, resume=True, lr=req.lr * 2))
    second = run_training(replace(req, resume=True))
    assert second.result.steps_done == 16
    a, b = straight.result.head.state_dict(), second.result.head.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [h["loss"] for h in straight.result.history] == [h["loss"] for h in second.result.history]


def test_a_failed_checkpoint_write_keeps_the_previous_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, {"step": 3, "head": {"w": torch.ones(2)}, "config": {}})

    def full_disk(obj: object, f: BinaryIO) -> None:
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_mod.torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="No space left.*previous checkpoint"):
        save_checkpoint(tmp_path, {"step": 9, "head": {}, "config": {}})
    monkeypatch.undo()
    assert load_checkpoint(tmp_path)["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    (tmp_path / "checkpoint.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(tmp_path)


def test_cli_quick_run_and_bad_input(bigram: Path, cache_dir: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    args = ["train-drafter", "eagle3", "-m", str(bigram), "-o", str(out), "--quick", "--steps", "6",
            "--cache-dir", str(cache_dir / "cli"), "-t", "1"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "trained eagle3 head" in err and "eagle3.gguf" in err
    assert main(args) == 1
    assert "already holds a training run" in capsys.readouterr().err
    # a target the trainer does not support: an EAGLE-3 draft file itself
    assert main(["train-drafter", "dflash", "-m", str(out / "eagle3.gguf"), "-o", str(tmp_path / "x"), "--quick"]) == 1
    assert "not a target spekula can train a drafter for" in capsys.readouterr().err
    with pytest.raises(ModelFileError):
        read_target_facts(str(out / "eagle3.gguf"))
    # an unusable device or run folder is a clear error before any work
    if not torch.cuda.is_available():
        assert main(["train-drafter", "eagle3", "-m", str(bigram), "-o", str(tmp_path / "z"), "--quick",
                     "--device", "cuda"]) == 1
        assert "CUDA is not available" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["train-drafter", "eagle3", "-m", str(bigram), "-o", str(blocker / "run"), "--quick"]) == 1
    assert "cannot create the run folder" in capsys.readouterr().err
    # a damaged feature cache is reported, not trained on
    shard = next((cache_dir / "cli").glob("shard-*.features.npy"))
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x55
    shard.write_bytes(bytes(raw))
    with pytest.raises(CacheError, match="damaged"):
        run_training(_quick("eagle3", bigram, tmp_path / "y", cache_dir, steps=2, cache_dir=cache_dir / "cli"))


def test_held_out_evaluation_counts_every_position(bigram: Path, cache_dir: Path, tmp_path: Path) -> None:
    req = _quick("dflash", bigram, tmp_path / "ev", cache_dir, steps=2)
    out = run_training(req)
    ev = out.summary["eval"]
    assert len(ev["accuracy"]) == 3 and all(0.0 <= a <= 1.0 for a in ev["accuracy"])
    assert 1.0 <= ev["accept_estimate"] <= 4.0


def test_an_moe_target_trains_and_its_head_is_lossless(tmp_path: Path) -> None:
    from spekula.fixtures.tiny_moe import tiny_moe_gguf_path

    target = tiny_moe_gguf_path("qwen3moe")
    out = run_training(quick_request("eagle3", str(target), tmp_path / "run", cache_dir=tmp_path / "cache", steps=8))
    assert out.gguf is not None
    spec = SpecParams(types=("draft-eagle3",), n_max=3, adaptive=False)
    outs, refs, st = engine_vs_plain(target, out.gguf, Eagle3Drafter.create, spec, n_predict=16)
    assert outs == refs and st["gen_drafts"] > 0


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_bf16_training_learns_and_differs_from_f32(kind: str, bigram: Path, cache_dir: Path, tmp_path: Path) -> None:
    steps = 24
    runs = {prec: run_training(_quick(kind, bigram, tmp_path / prec, cache_dir, steps=steps, precision=prec))
            for prec in ("f32", "bf16")}
    hist = runs["bf16"].result.history
    first = sum(h["loss"] for h in hist[:4]) / 4
    last = sum(h["loss"] for h in hist[-4:]) / 4
    assert last < 0.8 * first, (first, last)
    assert runs["bf16"].summary["config"]["precision"] == "bf16"
    a, b = runs["f32"].result.head.state_dict(), runs["bf16"].result.head.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the products really ran in bfloat16
    assert all(v.dtype != torch.bfloat16 for v in b.values())  # while the weights stayed float32
    with pytest.raises(ConfigError, match="precision"):
        run_training(_quick(kind, bigram, tmp_path / "bad", cache_dir, steps=2, precision="fp8"))
