"""Runs of steps in the worker thread against one hand-off per step, on SmolLM2, in one run.

    .venv/bin/python bench/step_handoff.py [-n 256] [--reps 6] [--threads 2]

The engine's event loop hands each step to a worker thread; handing over and back costs two thread
wake-ups. `Engine._steps` lets the worker make step after step while every busy slot generates
(docs/architecture.md, "Where the steps run"). With `STEPS_PER_HANDOFF_S = 0` it hands back after
every step, which is the engine as it was. Both run here alternately (the order flips every
repetition), on a fresh engine each time, for plain decoding and for adaptive `ngram-mod,ngram-simple`
on an open-ended chat prompt and a code rewrite; every answer is checked against plain decoding.
Printed: median decode tok/s per mode and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ is not a package
from adaptive import PAIR, Bench  # noqa: E402
from ngram import _CODE  # noqa: E402

import spekula.core.engine.engine as engine_module  # noqa: E402

PROMPTS = {
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "code-rewrite": "Rename the variable `total` to `grand_total` and return the whole code.\n\n" + _CODE,
}
CONFIGS = {"plain": ((), False), "pair adaptive": (PAIR, True)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--n-predict", type=int, default=256)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    args.backend = "native"
    bench = Bench(args)
    bench.one(bench.chat_prompt("Hello")[:32], (), False, {})  # warm-up
    budget = engine_module.STEPS_PER_HANDOFF_S
    modes = {"one step per hand-off": 0.0, f"runs of steps ({budget * 1e3:.0f} ms)": budget}
    prompts = {name: bench.chat_prompt(text) for name, text in PROMPTS.items()}
    want: dict[str, list[int]] = {}
    tok_s: dict[tuple[str, str, str], list[float]] = {}
    for rep in range(args.reps):
        order = list(modes) if rep % 2 == 0 else list(reversed(modes))
        for mode in order:
            engine_module.STEPS_PER_HANDOFF_S = modes[mode]
            for pname, prompt in prompts.items():
                for cname, (types, adaptive) in CONFIGS.items():
                    final = bench.one(prompt, types, adaptive, {})
                    got = [int(t) for t in final.tokens]
                    bench.check(f"{pname}/{cname}/{mode}", got, want.setdefault(pname, got))
                    tok_s.setdefault((pname, cname, mode), []).append(len(got) / final.timings["predicted_ms"] * 1e3)
    engine_module.STEPS_PER_HANDOFF_S = budget
    old, new = modes
    print(f"model {Path(bench.model).name}, {args.threads} threads, n_predict {args.n_predict}, {args.reps} "
          f"repetitions, decode tok/s (median)\n")
    print(f"| prompt | drafters | {old} | {new} | ratio |")
    print("|---|---|---:|---:|---:|")
    for pname in prompts:
        for cname in CONFIGS:
            a, b = (statistics.median(tok_s[(pname, cname, m)]) for m in (old, new))
            print(f"| {pname} | {cname} | {a:.1f} | {b:.1f} | {b / a:.3f}x |")
    print("\nOK: every output equals plain decoding" if not bench.failures else f"\nDIFFERENT: {bench.failures}")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
