"""Prompt speed by the native backend's rows per forward (`FORWARD_ROW_CAP`), caps alternating.

    .venv/bin/python bench/row_cap.py -m MODEL.gguf [--caps 512,256,128] [--reps 5] [--threads 1]

A prompt of `--tokens` random token ids (fixed seed) is evaluated from an empty sequence with each cap in
turn, `--reps` times; the wanted rows' logits must be bitwise those of the first run (rounds give the bits
one forward would). Prints each cap's prompt tok/s per repetition and each cap's median ratio to the
first cap's, pair by pair (the machine's drift between repetitions drops out of the ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from spekula.backends.native.backend import NativeBackend
from spekula.core.backend import BackendOptions, SeqInput


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--caps", default="512,256,128", help="rows per forward, comma-separated; the first is the base")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args(argv)
    caps = [int(c) for c in args.caps.split(",")]
    backend = NativeBackend(args.model, BackendOptions(n_ctx=max(2048, args.tokens + 1), n_seq_max=1,
                                                       threads=args.threads))
    tokens = np.random.default_rng(0).integers(10, backend.info.n_vocab, args.tokens).astype(np.int32)
    wanted = np.unique(np.array([0, args.tokens // 4, args.tokens // 2, args.tokens - 1], np.int32))
    seq = backend.new_seq()
    tps: dict[int, list[float]] = {c: [] for c in caps}
    reference: np.ndarray | None = None
    for _ in range(args.reps):
        for cap in caps:
            backend.forward_row_cap = cap
            backend.truncate(seq, 0)
            t = time.perf_counter()
            logits = backend.forward([SeqInput(seq, tokens, 0, wanted)])[0].logits
            tps[cap].append(args.tokens / (time.perf_counter() - t))
            if reference is None:
                reference = logits.copy()
            elif not np.array_equal(reference, logits):
                raise SystemExit(f"logits at cap {cap} differ from cap {caps[0]}'s")
    backend.close()
    base = tps[caps[0]]
    for cap in caps:
        ratio = statistics.median(a / b for a, b in zip(tps[cap], base, strict=True))
        print(f"cap {cap:4d}: prompt tok/s {', '.join(f'{v:.1f}' for v in tps[cap])}; median x cap {caps[0]}: {ratio:.3f}")
    print("logits bitwise equal at every cap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
