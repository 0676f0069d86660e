"""One EAGLE-3 draft step on the native kernels against the torch runtime, side by side in one run.

    .venv/bin/python bench/draft_step.py [-m MODEL.gguf] [-md EAGLE3.gguf] [-t 2] [--reps 200]

The head (default: the one shipped for the target) runs beside a native target backend, as
draft-eagle3 runs it: the native runtime over the target's threads, the torch runtime on one
thread (as the drafter sets it beside a native target), in float32. After 64 rows of context, each
shape is timed `--reps` times, in blocks of 20 alternating between the runtimes, and the medians are printed with
their ratio: one row with logits (a draft step), one row without (a context row), four rows without
(a round's catch-up), and the encoder over two rows of target features.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

# Reps run in blocks per runtime, the blocks alternating: steps follow one another as a draft's do
# (the native pool's threads stay awake between them), and slow drift in the machine's load cancels.
BLOCK = 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-md", "--draft", help="EAGLE-3 head GGUF (default: the one shipped for the target)")
    p.add_argument("-t", "--threads", type=int, default=2, help="the target's threads (default 2)")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)

    from spekula.backends.gguf.default_model import ensure_default_model
    from spekula.core.backend import BackendOptions, load_backend
    from spekula.core.drafting.draft_models import Eagle3Rows, Eagle3Runtime
    from spekula.drafters.model.runtimes import load_draft_runtime
    from spekula.drafters.model.shipped_heads import find_shipped_head

    model = args.model or str(ensure_default_model())
    draft = args.draft or find_shipped_head(model, "eagle3")
    if draft is None:
        raise SystemExit(f"no EAGLE-3 head shipped for {model}; pass -md FILE")
    options = BackendOptions(n_ctx=512, n_seq_max=1, threads=args.threads)
    target = load_backend("native", model, options)
    runtimes: dict[str, Eagle3Runtime] = {}
    for name, opts in (("native", options), ("torch", BackendOptions(n_ctx=512, n_seq_max=1, dtype="f32"))):
        rt = load_draft_runtime(name, str(draft), target.info, opts, target_backend=target)
        rt.share_cpu()
        runtimes[name] = rt
    H, T = target.info.n_embd, runtimes["native"].info.target_hidden
    rng = np.random.default_rng(0)
    context = rng.standard_normal((64, 3 * T)).astype(np.float32)
    seqs = {}
    for name, rt in runtimes.items():
        seqs[name] = s = rt.new_seq()
        g = rt.encode(context)
        rt.decode([Eagle3Rows(s, np.arange(100, 164, dtype=np.int32), g, 0, want_logits=False)])

    g1 = rng.standard_normal((4, H)).astype(np.float32)
    feats = rng.standard_normal((2, 3 * T)).astype(np.float32)

    def step(n: int, logits: bool) -> Callable[[str], object]:
        return lambda name: runtimes[name].decode([Eagle3Rows(seqs[name], np.full(n, 7, np.int32), g1[:n], 64, logits)])

    shapes: list[tuple[str, Callable[[str], object]]] = [
        ("1 row with logits (a draft step)", step(1, True)), ("1 row, no logits", step(1, False)),
        ("4 rows, no logits", step(4, False)), ("encoder, 2 rows", lambda name: runtimes[name].encode(feats))]
    print(f"target {model}\nhead {draft}\nmedian ms over {args.reps} reps in alternating blocks of {BLOCK} "
          f"({args.threads} target threads)")
    print(f"{'':34}{'native':>9}{'torch':>9}{'torch/native':>14}")
    for label, fn in shapes:
        times: dict[str, list[float]] = {name: [] for name in runtimes}
        for _ in range(max(1, args.reps // BLOCK)):
            for name in runtimes:
                for _ in range(BLOCK):
                    t0 = time.perf_counter()
                    fn(name)
                    times[name].append(time.perf_counter() - t0)
        med = {name: float(np.median(v)) * 1e3 for name, v in times.items()}
        print(f"{label:34}{med['native']:>9.3f}{med['torch']:>9.3f}{med['torch'] / med['native']:>13.1f}x")
    target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
