"""The training loop: optimise a draft head on a feature cache, checkpoint it, export it.

Everything a step computes is a function of (run configuration, step, the state after the previous
step): batches and the head's randomness come from (seed, step) and nothing else, so a run resumed
from a checkpoint reaches bit-identically the weights an uninterrupted run reaches (for the same
device and thread count). Ctrl-C asks the loop to stop after the current step and checkpoint.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spekula.core.errors import ConfigError
from spekula.training.batches import BatchSource
from spekula.training.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from spekula.training.feature_cache import FeatureCache
from spekula.training.head_api import DraftHead, HeadMetrics, TargetFacts
from spekula.training.head_factory import build_head
from spekula.training.run_config import RunConfig


@dataclass(slots=True)
class StepReport:
    step: int
    steps: int
    loss: float
    accept_estimate: float  # running estimate of mean acceptance length at n_max 6
    tokens_per_s: float
    elapsed_s: float


@dataclass(slots=True)
class TrainResult:
    head: DraftHead
    steps_done: int
    interrupted: bool
    history: list[dict[str, float]]
    eval: dict[str, Any]
    train_seconds: float


ACCEPT_N_MAX = 6  # the acceptance estimate is for --spec-draft-n-max 6
PRECISIONS = ("f32", "bf16")  # spelled as --dtype and --outtype spell them


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown training precision {precision!r}; choose one of {', '.join(PRECISIONS)}")


def autocast(precision: str, device: torch.device) -> torch.autocast:
    """The forward's numeric mode: bf16 runs the matrix products in bfloat16 (about 1.7x faster on a
    CPU with AVX-512 BF16), while parameters, gradients and the optimiser state stay float32."""
    check_precision(precision)
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def learning_rate(cfg: RunConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t))))


@contextmanager
def stop_on_sigint() -> Iterator[list[bool]]:
    """The first Ctrl-C sets a flag the loop checks between steps; a second one interrupts at once."""
    flag = [False]

    def handler(signum: int, frame: object) -> None:
        if flag[0]:
            raise KeyboardInterrupt
        flag[0] = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no handler, Ctrl-C behaves as usual
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + step) % (1 << 63))
    return gen


def evaluate(head: DraftHead, source: BatchSource, seed: int, device: torch.device,
             precision: str = "f32") -> dict[str, Any]:
    """Loss and per-position accuracy on the held-out sequences (no gradient), in the training precision."""
    head.train(False)
    total, n = 0.0, 0
    metrics = HeadMetrics()
    with torch.no_grad(), autocast(precision, device):
        for k, batch in enumerate(source.eval_batches()):
            loss, m = head.loss(batch, step_generator(seed, -1 - k, device))
            total += float(loss)
            n += 1
            metrics.add(m)
    head.train(True)
    return {"loss": total / max(1, n), "accuracy": metrics.accuracy(),
            "accept_estimate": metrics.expected_accept_length(ACCEPT_N_MAX)}


def train(cfg: RunConfig, facts: TargetFacts, cache: FeatureCache, cache_layers: list[int], run_dir: Path, *,
          resume: bool, device: str = "cpu", checkpoint_every_s: float = 300.0,
          progress: Callable[[StepReport], None] | None = None) -> TrainResult:
    dev = torch.device(device)
    check_precision(cfg.precision)  # before any work
    run_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] | None = load_checkpoint(run_dir) if resume and has_checkpoint(run_dir) else None
    if state is not None and state["config"] != cfg.to_dict():
        saved, asked = state["config"], cfg.to_dict()
        diff = sorted(k for k in set(saved) | set(asked) if saved.get(k) != asked.get(k))
        raise ConfigError(f"--resume: {run_dir} was trained with other settings ({', '.join(diff)}); "
                          f"repeat the original command line with --resume")
    head = build_head(cfg, facts, cache, dev)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    start, history, spent = 0, [], 0.0
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        start, history, spent = int(state["step"]), list(state["history"]), float(state.get("train_seconds", 0.0))
    source = BatchSource(cache, cache_layers, head.layers, n_embd=facts.n_embd, seq_len=cfg.seq_len,
                         batch_seqs=cfg.batch_seqs, seed=cfg.seed, n_eval=cfg.n_eval, answer_only=cfg.answer_only,
                         soft_labels=cfg.soft_labels, device=dev)

    def checkpoint(step: int, seconds: float) -> None:
        save_checkpoint(run_dir, {"step": step, "head": head.state_dict(), "optimizer": opt.state_dict(),
                                  "config": cfg.to_dict(), "history": history, "train_seconds": seconds})

    head.train(True)
    t0 = time.perf_counter()
    last_ckpt = t0
    running = HeadMetrics()
    step, interrupted, tokens_seen = start, False, 0
    with stop_on_sigint() as stop:
        while step < cfg.steps:
            if stop[0]:
                interrupted = True
                break
            batch = source.batch(step)
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, step)
            with autocast(cfg.precision, dev):
                loss, m = head.loss(batch, step_generator(cfg.seed, step, dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip > 0:
                torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], cfg.clip)
            opt.step()
            step += 1
            tokens_seen += int(batch.valid.sum())
            running = _decayed(running, m)
            elapsed = time.perf_counter() - t0
            estimate = running.expected_accept_length(ACCEPT_N_MAX)
            history.append({"step": step, "loss": float(loss.detach()), "accept_estimate": estimate})
            if progress is not None:
                progress(StepReport(step, cfg.steps, float(loss.detach()), estimate, tokens_seen / max(elapsed, 1e-9),
                                    spent + elapsed))
            if time.perf_counter() - last_ckpt >= checkpoint_every_s and step < cfg.steps:
                checkpoint(step, spent + time.perf_counter() - t0)
                last_ckpt = time.perf_counter()
    seconds = spent + time.perf_counter() - t0
    checkpoint(step, seconds)
    ev = evaluate(head, source, cfg.seed, dev, cfg.precision) if not interrupted else {}
    return TrainResult(head, step, interrupted, history, ev, seconds)


def _decayed(running: HeadMetrics, m: HeadMetrics, keep: float = 0.9) -> HeadMetrics:
    """An exponentially decayed sum of accuracy counts (the progress line's running estimate)."""
    out = HeadMetrics([c * keep for c in running.correct], [n * keep for n in running.count])
    out.add(m)
    return out
