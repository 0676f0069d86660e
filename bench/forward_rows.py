"""What a verification row costs: the native forward of 1..N rows after a context, phase by phase.

    .venv/bin/python bench/forward_rows.py [-m MODEL.gguf] [--threads 2] [--contexts 300,700]
                                           [--rows 1,2,4,8,16,32] [--reps 12]

The adaptive planner (core/policy/cost_model.py) keeps a draft token only when its chance of acceptance pays
for the row it adds to the target's forward, so the cost of a row decides how far speculation can
go. For each context length and row count this prints the median time of a forward whose rows all
want logits (as a verification does), what each row beyond the first adds, and thread 0's time in
each phase of the forward (the native library's SPEKULA_NATIVE_PROFILE=1 timers; "wait" is its time
at the barriers, waiting for the other threads). Token ids are drawn at random with a fixed seed:
the kernels' time does not depend on which tokens they read.

On a recurrent (hybrid) target every timed forward follows a checkpoint (O(1), untimed), as a
verification does, and is then taken back to half its rows, as a partly rejected draft is: the kept
rows are replayed from the checkpoint, by the next forward. The "after rollback ms" column times that
truncate and a 1-row forward after it, to set against the 1-row forward's own time; then the sequence
goes back to the context.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from spekula.backends.native import lib as native_lib
from spekula.core.backend import Backend, BackendOptions, SeqInput, load_backend


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="300,700", help="context lengths before the measured rows")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="rows per measured forward")
    p.add_argument("--reps", type=int, default=12, help="timed forwards per (context, rows)")
    return p.parse_args(argv)


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise SystemExit(f"expected positive integers separated by commas, got {text!r}")
    return values


def timed_forward(backend: Backend, seq: int, start: int, tokens: np.ndarray) -> tuple[float, float, dict[str, float]]:
    """Seconds of one forward of `tokens` at `start` with every row's logits, (recurrent targets only,
    else 0) of the truncate that keeps half of its rows plus a 1-row forward after it, and the phases
    of the first forward alone; the sequence ends at `start` again."""
    recurrent = backend.info.recurrent
    if recurrent:
        backend.checkpoint(seq)
    native_lib.profile_report()  # reset the phase timers
    t0 = time.perf_counter()
    backend.forward([SeqInput(seq_id=seq, tokens=tokens, start=start, logit_rows=np.arange(tokens.size))])
    seconds = time.perf_counter() - t0
    phases = native_lib.profile_report()
    after = 0.0
    if recurrent:
        kept = start + tokens.size // 2
        t0 = time.perf_counter()
        backend.truncate(seq, kept)
        backend.forward([SeqInput(seq_id=seq, tokens=tokens[:1], start=kept, logit_rows=np.arange(1))])
        after = time.perf_counter() - t0
        backend.truncate(seq, start)
    return seconds, after, phases


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    contexts, row_counts = int_list(args.contexts), int_list(args.rows)
    os.environ["SPEKULA_NATIVE_PROFILE"] = "1"  # read by the library at its first forward

    from spekula.backends.gguf.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    n_ctx = max(contexts) + max(row_counts) + 1
    backend = load_backend("native", model, BackendOptions(n_ctx=n_ctx, n_seq_max=1, threads=args.threads))
    n_vocab = backend.info.n_vocab
    rng = np.random.default_rng(0)
    print(f"model {os.path.basename(model)}, the native backend, {args.threads} threads, median of {args.reps} "
          f"forwards, every row with logits; phases: thread 0's ms per forward")
    for n_keys in contexts:
        seq = backend.new_seq()
        context = rng.integers(0, n_vocab, n_keys).astype(np.int32)
        backend.forward([SeqInput(seq_id=seq, tokens=context, start=0, logit_rows=np.empty(0, dtype=np.int64))])
        print(f"\n### after {n_keys} tokens of context\n")
        header = None
        first: tuple[int, float] | None = None
        for rows in row_counts:
            for _ in range(2):  # warm-up: scratch buffers sized for this row count
                timed_forward(backend, seq, n_keys, rng.integers(0, n_vocab, rows).astype(np.int32))
            times = [timed_forward(backend, seq, n_keys, rng.integers(0, n_vocab, rows).astype(np.int32))
                     for _ in range(args.reps)]
            phases = {k: sum(t[2][k] for t in times) / args.reps for k in times[0][2] if times[0][2][k] > 0}
            if header is None:
                header = list(phases)
                print("| rows | forward ms | ms per row beyond the first count | after rollback ms | " + " | ".join(header)
                      + " |")
                print("|---:|---:|---:|---:|" + "---:|" * len(header))
            ms = statistics.median(t[0] for t in times) * 1e3
            after_ms = statistics.median(t[1] for t in times) * 1e3
            first = (rows, ms) if first is None else first
            extra = f"{(ms - first[1]) / (rows - first[0]):.2f}" if rows > first[0] else "-"
            cells = " | ".join(f"{phases.get(k, 0.0) * 1e3:.2f}" for k in header)
            print(f"| {rows} | {ms:.2f} | {extra} | {after_ms:.2f} | {cells} |")
        backend.free_seq(seq)
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
