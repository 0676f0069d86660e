"""The machine's memory read bandwidth, measured here and now, to read decode speeds against.

At 1B parameters and up decoding streams every weight once per token, so tokens/s x file bytes is
the read bandwidth an engine reaches; divided by what this machine reads at best it says how close
to the memory bound an engine runs, a number that travels between machines better than a speed.

What a model reads per decoded token (:func:`bytes_read_per_token`) is its file less the token
embedding when the output head is separate (one row of it is read), and for MoE blocks only the used
experts' share of the expert tensors (``expert_used_count / expert_count``, the average a token reads).

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


def bytes_read_per_token(model: str) -> int:
    """Bytes of `model`'s weights one decoded token reads: every tensor, except the token embedding
    when an output head is stored apart and Gemma 4's per-layer token embeddings (lookups: a token
    reads its one row), and the used share of the expert tensors."""
    from spekula.core.modelfile.gguf_file import GGUFFile

    f = GGUFFile(model)
    arch = f.architecture
    used, experts = f.get(f"{arch}.expert_used_count", 0), f.get(f"{arch}.expert_count", 0)
    entries = list(f.tensors())
    tied = not any(e.name == "output.weight" for e in entries)
    total = 0.0
    for e in entries:
        if (e.name == "token_embd.weight" and not tied) or e.name == "per_layer_token_embd.weight":
            continue
        share = used / experts if experts and "_exps." in e.name else 1.0
        total += e.data.nbytes * share
    return int(total)


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
