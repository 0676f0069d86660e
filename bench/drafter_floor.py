"""A model drafter never slower than plain: alternating runs of plain decoding and each SmolLM2 head.

    python bench/drafter_floor.py [--heads eagle3,dflash] [--reps 3] [--code] [-t 1] [-n 128]

Every generation gets a fresh engine (as in bench/train_drafter.py, whose target, heads and prompts
this uses): plain, then the head with adaptive lengths, then plain again, per prompt and head, so
that a machine whose load drifts loads both sides alike. Per run: plain's time per token (the mean
of the runs around it) over the head's, on the wall clock and in process CPU time; printed after
each repetition as medians and means. `--code`: the code prompts instead of the open-ended chats.
Outputs must equal plain decoding's (checked every run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ is not a package

import train_drafter as T  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="eagle3,dflash", help="shipped heads to run (train_drafter.py's rows)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--code", action="store_true", help="the code prompts instead of the chats")
    a = p.parse_args(argv)
    from spekula.backends.gguf.default_model import ensure_default_model

    model = str(ensure_default_model(quiet=True))
    target = T.Target(argparse.Namespace(threads=a.threads, backend="auto"), model, 2048)
    heads = T.find_heads(argparse.Namespace(eagle3=None, dflash=None), model)
    prompts = [q for q in T.make_prompts(target.tokenizer, 8, len(T.HAND_WRITTEN)) if q.chat != a.code]
    rows = [d for d in T.drafter_rows(heads) if d.label in a.heads.split(",")]
    target.generate(None, False, prompts[0].ids, 4)  # warm the target and each head's file
    for d in rows:
        target.generate(d, True, prompts[0].ids, 4)
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for rep in range(a.reps):
        for q in prompts:
            plain = target.generate(None, False, q.ids, a.n_predict)
            for d in rows:
                run = target.generate(d, True, q.ids, a.n_predict)
                after = target.generate(None, False, q.ids, a.n_predict)
                if run.tokens != after.tokens:
                    raise SystemExit(f"{d.label} on {q.name}: output differs from plain decoding")
                n = len(after.tokens)
                wall.setdefault(d.label, []).append((plain.seconds + after.seconds) / 2 / n / (run.seconds / n))
                cpu.setdefault(d.label, []).append((plain.cpu + after.cpu) / 2 / n / (run.cpu / n))
                plain = after
        print(f"after rep {rep + 1} (load {os.getloadavg()[0]:.1f}):", flush=True)
        for label in wall:
            w, c = wall[label], cpu[label]
            print(f"  {label:<7} x plain: wall median {statistics.median(w):.3f} mean {statistics.mean(w):.3f}  "
                  f"cpu median {statistics.median(c):.3f} mean {statistics.mean(c):.3f}  n={len(w)}", flush=True)
    target.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
