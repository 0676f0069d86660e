"""`spekula train-drafter {eagle3,dflash} -m TARGET.gguf -o DIR`: train a draft head by self-distillation."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from spekula.backends.convert.gguf_writer import OUTTYPES
from spekula.core.errors import ConfigError

HELP = "Train an EAGLE-3 or DFlash draft head for a target by self-distillation (CPU or CUDA)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=("eagle3", "dflash"), help="which kind of draft head to train")
    p.add_argument("-m", "--model", default=None, metavar="TARGET.gguf",
                   help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="run folder: checkpoint, hf/, <kind>.gguf, train.json")
    p.add_argument("--prompts", action="append", default=[], metavar="FILE",
                   help="prompt file(s) instead of the built-in set (one per line, a JSON list, or JSON lines with \"prompt\")")
    p.add_argument("--n-prompts", type=int, default=None, help="size of the built-in prompt set (default 2000)")
    p.add_argument("--tokens", type=int, default=None, help="distilled tokens to train on (default 400000)")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps (default 600)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data-order seed (default 0)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument("--resume", action="store_true", help="continue the run in DIR from its last checkpoint")
    p.add_argument("--quick", action="store_true", help="a seconds-long run for tiny test models")
    p.add_argument("--distill-only", action="store_true",
                   help="only build the self-distillation feature cache (so several trainings can then share it)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: torch's); results are "
                   "reproducible for a fixed seed and thread count")
    p.add_argument("--cache-dir", default=None, help="feature cache folder (default: under the spekula cache)")
    p.add_argument("--outtype", choices=list(OUTTYPES), default="f16", help="GGUF weight type (default f16)")
    p.add_argument("--max-new", type=int, default=None, help="answer tokens per prompt (default 256)")
    p.add_argument("--temp", type=float, default=0.0, help="distillation temperature (default 0: greedy answers)")
    p.add_argument("--soft-top-k", type=int, default=0, metavar="K",
                   help="keep the target's K likeliest next tokens per position when distilling and train the head "
                   "on that distribution instead of the argmax alone (default 0: hard labels)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8)")
    p.add_argument("--precision", choices=("f32", "bf16"), default=None,
                   help="f32, or bf16 matrix products under autocast with float32 weights (faster where the "
                   "CPU or GPU has bfloat16 arithmetic; default f32)")
    p.add_argument("--checkpoint-every", type=float, default=300.0, metavar="SECONDS",
                   help="seconds between checkpoints (default 300)")
    p.add_argument("--draft-vocab", type=int, default=None, help="the draft vocabulary: the head drafts among the N most frequent labels of the "
                   "data (default 8192; eagle3 trains its own head over them, dflash keeps the target head's rows; "
                   "0 for dflash: borrow the target's whole head)")
    p.add_argument("--ttt-steps", type=int, default=None, help="eagle3: unrolled training-time-test steps (default 4)")
    p.add_argument("--block-size", type=int, default=None, help="dflash: block size (default 8)")
    p.add_argument("--draft-layers", type=int, default=None, help="dflash: decoder layers (default 2)")


def _request(args: argparse.Namespace, target: str) -> Any:
    from dataclasses import replace

    from spekula.training.distill import DistillOptions
    from spekula.training.run import TrainRequest, quick_request

    out = Path(args.output)
    req = quick_request(args.kind, target, out) if args.quick else TrainRequest(
        kind=args.kind, target=target, out_dir=out, steps=600, tokens=400_000,
        distill=DistillOptions(max_new=256, parallel=16))
    head = dict(req.head)
    names = (("draft_vocab", "draft_vocab"), ("ttt_steps", "ttt_steps")) if args.kind == "eagle3" else \
        (("block_size", "block_size"), ("draft_layers", "n_layer"), ("draft_vocab", "draft_vocab"))
    head.update({key: getattr(args, opt) for opt, key in names if getattr(args, opt) is not None})
    if args.kind == "dflash" and head.get("draft_vocab") == 0:
        head["draft_vocab"] = None
    given = {k: v for k, v in {"steps": args.steps, "tokens": args.tokens, "n_prompts": args.n_prompts,
                               "lr": args.lr, "batch_seqs": args.batch, "precision": args.precision}.items()
             if v is not None}
    # The distillation seed only matters when answers are sampled; greedy data stay shareable across seeds.
    # The target answers on the training device too (a large target distils on its GPU).
    if args.soft_top_k < 0:
        raise ConfigError(f"--soft-top-k must be 0 or more, got {args.soft_top_k}")
    distill = replace(req.distill, max_new=args.max_new or req.distill.max_new, temperature=args.temp,
                      seed=args.seed if args.temp > 0 else 0, device=args.device, soft_top_k=args.soft_top_k)
    return replace(req, **given, head=head, distill=distill, seed=args.seed, prompt_files=tuple(args.prompts),
                   device=args.device, resume=args.resume, threads=args.threads,
                   cache_dir=Path(args.cache_dir) if args.cache_dir else None, outtype=args.outtype,
                   checkpoint_every_s=args.checkpoint_every,
                   command=" ".join(shlex.quote(a) for a in ["spekula", "train-drafter", *sys.argv[2:]]))


class _Progress:
    """A rich progress bar on a terminal; otherwise one plain line every few seconds."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.bar: Any = None
        self.task: Any = None
        self.phase = ""

    def _start(self, phase: str, total: int) -> None:
        if not self.tty or self.phase == phase:
            self.phase = phase
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.close()
        self.phase = phase
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[info]}"), console=Console(stderr=True), transient=False)
        self.bar.start()
        self.task = self.bar.add_task(phase, total=total, info="")

    def distill(self, p: Any) -> None:
        self._start("distilling", p.tokens_goal)
        info = f"{p.prompts_done}/{p.prompts_total} prompts, {p.tokens_per_s:,.0f} tok/s"
        self._show(min(p.tokens, p.tokens_goal), info, f"distill: {p.tokens:,}/{p.tokens_goal:,} tokens, {info}")

    def step(self, r: Any) -> None:
        self._start("training", r.steps)
        info = f"loss {r.loss:.3f}  accept~{r.accept_estimate:.2f}  {r.tokens_per_s:,.0f} tok/s"
        self._show(r.step, info, f"train {self.kind}: step {r.step}/{r.steps}  {info}  {r.elapsed_s:.0f}s")

    def _show(self, done: int, info: str, line: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, info=info)
            return
        now = time.monotonic()
        if now - self.last >= 10.0:
            self.last = now
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def run(args: argparse.Namespace) -> int:
    from spekula.backends.gguf.default_model import ensure_default_model
    from spekula.training.run import prepare_data, run_training

    target = args.model or str(ensure_default_model())
    req = _request(args, target)
    ui = _Progress(args.kind)
    try:
        if args.distill_only:
            data = prepare_data(req, ui.distill)
            ui.close()
            print(f"feature cache {data.cache.root}: {len(data.cache)} sequences, {data.cache.n_tokens} tokens "
                  f"({data.seconds:.0f}s)", file=sys.stderr)
            return 0
        outcome = run_training(req, on_distill=ui.distill, on_step=ui.step)
    except KeyboardInterrupt:  # the training loop handles Ctrl-C itself; this is the distillation
        ui.close()
        print("interrupted while distilling; every finished shard of the feature cache is kept: run the same "
              "command again to continue", file=sys.stderr)
        return 130
    finally:
        ui.close()
    res = outcome.result
    if res.interrupted:
        print(f"interrupted at step {res.steps_done}/{req.steps}; the checkpoint in {req.out_dir} is saved: "
              f"run the same command with --resume to continue", file=sys.stderr)
        return 130
    ev = outcome.summary["eval"]
    acc = " ".join(f"{a:.2f}" for a in ev.get("accuracy", [])[:8])
    print(f"trained {req.kind} head in {res.train_seconds:.0f}s ({res.steps_done} steps); held-out loss "
          f"{ev.get('loss', float('nan')):.3f}, per-position accuracy {acc}, estimated acceptance length "
          f"{ev.get('accept_estimate', float('nan')):.2f} at n_max 6", file=sys.stderr)
    print(f"wrote {outcome.gguf} (use it with --spec-type draft-{req.kind} -md {outcome.gguf}) and {outcome.hf}/",
          file=sys.stderr)
    return 0
