"""One `spekula train-drafter` run end to end: distil (or reuse the cache), train, export, record.

The run folder ``-o DIR`` holds ``checkpoint.pt`` (resumable), ``hf/`` (the Hugging Face checkpoint),
``<kind>.gguf`` (converted against the target GGUF) and ``train.json`` (the recipe: target, data,
options, seed, timings and the held-out evaluation), everything needed to reproduce or audit the head.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from spekula.backends.convert.output import atomic_output
from spekula.backends.torch.backend import resolve_device
from spekula.core.backend import BackendOptions
from spekula.core.errors import ConfigError
from spekula.training.checkpoint import has_checkpoint
from spekula.training.distill import DistillOptions, DistillProgress, distill
from spekula.training.export import export_gguf, write_hf_checkpoint
from spekula.training.feature_cache import FeatureCache
from spekula.training.head_api import TargetFacts, read_target_facts
from spekula.training.head_factory import HEAD_KINDS, default_layers
from spekula.training.loop import StepReport, TrainResult, train
from spekula.training.prompts import builtin_prompts, iter_prompt_files
from spekula.training.run_config import RunConfig

DEFAULT_PROMPTS = 2000


@dataclass(frozen=True, slots=True)
class TrainRequest:
    kind: str
    target: str
    out_dir: Path
    steps: int
    tokens: int
    seed: int = 0
    prompt_files: tuple[str, ...] = ()
    n_prompts: int = DEFAULT_PROMPTS
    device: str = "cpu"
    resume: bool = False
    threads: int = 0
    cache_dir: Path | None = None
    outtype: str = "f16"
    distill: DistillOptions = DistillOptions()
    lr: float = 1e-3
    precision: str = "f32"
    batch_seqs: int = 8
    seq_len: int = 512
    n_eval: int = 16
    checkpoint_every_s: float = 300.0
    head: dict[str, Any] = field(default_factory=dict)
    command: str = ""


QUICK_HEAD = {
    "eagle3": {"draft_vocab": 256, "ttt_steps": 3},
    "dflash": {"n_layer": 1, "block_size": 4, "anchors_per_seq": 8, "draft_vocab": 256},
}
QUICK_STEPS = {"eagle3": (40, 3e-3), "dflash": (200, 1e-2)}  # (steps, peak learning rate)


def quick_request(kind: str, target: str, out_dir: Path, **over: Any) -> TrainRequest:
    """Settings for the tiny fixtures: the whole run in seconds (tests, --quick)."""
    steps, lr = QUICK_STEPS.get(kind, (40, 3e-3))
    base: dict[str, Any] = dict(kind=kind, target=target, out_dir=out_dir, steps=steps, tokens=4000, n_prompts=48,
                                distill=DistillOptions(max_new=32, parallel=8, n_ctx=1024, shard_prompts=16),
                                lr=lr, batch_seqs=4, seq_len=128, n_eval=4, head=dict(QUICK_HEAD.get(kind, {})))
    base.update(over)
    return TrainRequest(**base)


@dataclass(slots=True)
class TrainOutcome:
    result: TrainResult
    gguf: Path | None
    hf: Path | None
    summary: dict[str, Any]


@dataclass(slots=True)
class PreparedData:
    facts: TargetFacts
    layers: tuple[int, ...]
    cache: FeatureCache  # its root and recipe say where the data are and what made them
    seconds: float


def prepare_data(req: TrainRequest, on_distill: Callable[[DistillProgress], None] | None = None) -> PreparedData:
    """Distil the request's data into its feature cache (or find it there)."""
    if req.kind not in HEAD_KINDS:
        raise ConfigError(f"unknown drafter kind {req.kind!r}; choose one of {', '.join(HEAD_KINDS)}")
    if req.tokens < 1:
        raise ConfigError("--tokens must be positive")
    facts = read_target_facts(req.target)
    layers = tuple(req.head.get("layers") or default_layers(req.kind, facts.n_layer))
    prompts = list(iter_prompt_files(list(req.prompt_files))) if req.prompt_files else \
        builtin_prompts(req.n_prompts, seed=0)
    t0 = time.perf_counter()
    dopts = req.distill if req.threads <= 0 else replace(req.distill, threads=req.threads)
    cache = distill(req.target, prompts, layers, req.cache_dir, req.tokens, dopts, on_distill)
    return PreparedData(facts, layers, cache, time.perf_counter() - t0)


def run_training(req: TrainRequest, *, on_distill: Callable[[DistillProgress], None] | None = None,
                 on_step: Callable[[StepReport], None] | None = None) -> TrainOutcome:
    if req.steps < 1:
        raise ConfigError("--steps must be positive")
    out = req.out_dir
    if out.exists() and not out.is_dir():
        raise ConfigError(f"-o {out}: exists and is not a folder")
    if has_checkpoint(out) and not req.resume:
        raise ConfigError(f"-o {out} already holds a training run; pass --resume to continue it or choose another folder")
    if req.resume and not has_checkpoint(out):
        raise ConfigError(f"--resume: {out} holds no checkpoint to continue")
    resolve_device(BackendOptions(device=req.device))  # a clear error before any work, not torch's
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"-o {out}: cannot create the run folder: {exc.strerror or exc}") from None
    if req.threads > 0:
        torch.set_num_threads(req.threads)
    data = prepare_data(req, on_distill)
    facts, layers, cache = data.facts, data.layers, data.cache
    head_opts = {**req.head, "layers": list(layers)}

    cfg = RunConfig(kind=req.kind, steps=req.steps, seed=req.seed, lr=req.lr, precision=req.precision,
                    batch_seqs=req.batch_seqs, seq_len=req.seq_len, n_eval=req.n_eval, head=head_opts,
                    soft_labels=req.distill.soft_top_k > 0)
    result = train(cfg, facts, cache, list(layers), out, resume=req.resume, device=req.device,
                   checkpoint_every_s=req.checkpoint_every_s, progress=on_step)
    summary: dict[str, Any] = {
        "command": req.command, "kind": req.kind, "target": os.path.basename(req.target), "target_digest":
        cache.recipe["target"], "seed": req.seed, "steps": req.steps, "steps_done": result.steps_done,
        "threads": torch.get_num_threads(), "device": req.device, "config": cfg.to_dict(),
        "data": {"recipe": cache.recipe, "cache": str(cache.root), "sequences": len(cache), "tokens": cache.n_tokens,
                 "prompts": "files" if req.prompt_files else f"built-in ({req.n_prompts})"},
        "distill_seconds": round(data.seconds, 1), "train_seconds": round(result.train_seconds, 1),
        "eval": result.eval,
    }
    if result.interrupted:
        return TrainOutcome(result, None, None, summary)
    hf = write_hf_checkpoint(result.head, out / "hf")
    gguf = export_gguf(hf, req.target, out / f"{req.kind}.gguf", req.outtype)
    summary["gguf"] = gguf.name
    with atomic_output(out / "train.json", "the run summary") as tmp:
        tmp.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return TrainOutcome(result, gguf, hf, summary)
