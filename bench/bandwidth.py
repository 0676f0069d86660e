"""The machine's memory read bandwidth, measured here and now, to read decode speeds against.

At 1B parameters and up decoding streams every weight once per token, so tokens/s x file bytes is
the read bandwidth an engine reaches; divided by what this machine reads at best it says how close
to the memory bound an engine runs, a number that travels between machines better than a speed.

The measurement OR-reduces a buffer far larger than any cache (1 GiB of 64-bit words by default) on
`threads` threads, each its own slice (numpy releases the GIL inside the reduction), best of `reps`
passes. The OR reduction is the cheapest vectorised pass numpy has: a float sum (pairwise) or max
reads measurably slower than memory allows here.

    .venv/bin/python bench/bandwidth.py [--threads 1,2] [--mib 1024]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np


def _read(part: np.ndarray, barrier: threading.Barrier) -> None:
    barrier.wait()
    int(np.bitwise_or.reduce(part))


def read_bandwidth(threads: int, mib: int = 1024, reps: int = 5) -> float:
    """Bytes per second `threads` threads read from memory (best of `reps` passes over `mib` MiB)."""
    buf = np.ones(mib * 2**20 // 8, np.uint64)
    slices = np.array_split(buf, threads)
    best = 0.0
    for _ in range(reps):
        barrier = threading.Barrier(threads + 1)

        workers = [threading.Thread(target=_read, args=(s, barrier)) for s in slices]
        for w in workers:
            w.start()
        barrier.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        best = max(best, buf.nbytes / (time.perf_counter() - t0))
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--mib", type=int, default=1024)
    args = p.parse_args()
    for t in (int(v) for v in args.threads.split(",")):
        print(f"{t} thread(s): {read_bandwidth(t, args.mib) / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
