"""Speculation speed-up under synthetic acceptance, measured side by side in one run.

    .venv/bin/python bench/spec.py [-m MODEL] [-n 64] [--lengths 1.5,2,3,4] [--n-max 4,8] [--device cpu]

For each (n_max, mean acceptance length L) the engine runs a bench-local drafter that always
proposes n_max tokens, verified with llama.cpp's synthetic acceptance (`--spec-synth-len L`), and
reports tokens/s against plain decoding in the same process, the measured mean acceptance length,
and the speed-up that L predicts from the measured cost of a (k+1)-row verification forward
relative to a 1-row forward: predicted = L * t(1) / t(k+1). The text produced under synthetic
acceptance is not valid output; only the timing matters.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import ClassVar

import anyio
import numpy as np

from spekula.core.backend import Backend, BackendOptions, SeqInput, load_backend
from spekula.core.drafter import Draft, DrafterContext, DraftlessDrafter, DraftRequest
from spekula.core.engine import Engine, EngineConfig
from spekula.core.events import FinalEvent
from spekula.core.gguf_file import GGUFFile
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.tokenizer import Tokenizer

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class FillDrafter(DraftlessDrafter):
    """Always proposes n_max copies of a fixed non-EOG token: under synthetic acceptance only length matters."""

    name: ClassVar[str] = "bench-fill"

    def __init__(self, n_max: int, token: int) -> None:
        self.n_max = n_max
        self.draft_cap = n_max  # the engine sizes synthetic rates and tables by it
        self.token = token

    @classmethod
    def create(cls, ctx: DrafterContext) -> FillDrafter:
        return cls(ctx.spec.n_max, 0)

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft([self.token] * min(self.n_max, r.n_max)) for r in requests]

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None


def forward_costs(backend: Backend, prompt: list[int], rows: list[int], reps: int) -> dict[int, float]:
    """CPU seconds of one forward of `rows` new tokens after the prompt (all rows give logits).

    Thread CPU time, the minimum over interleaved repetitions: on a shared machine wall-clock time
    mostly measures the neighbours, while with one torch thread the forward's work runs on this
    thread and its CPU time barely moves under contention.
    """
    seq = backend.new_seq()
    backend.forward([SeqInput(seq, np.asarray(prompt, np.int32), 0)])
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(reps):
        for n in rows:
            toks = np.full(n, 0, dtype=np.int32)
            t0 = time.thread_time()
            backend.forward([SeqInput(seq, toks, len(prompt), np.arange(n))])
            best[n] = min(best[n], time.thread_time() - t0)
            backend.truncate(seq, len(prompt))
    backend.free_seq(seq)
    return best


def run_once(backend: Backend, tok: Tokenizer, prompt: list[int], n_predict: int, spec: SpecParams,
             drafters: list[object]) -> tuple[FinalEvent, float, float]:
    """One request on a fresh engine: its final event, mean acceptance length, process CPU s/token."""
    engine = Engine(backend, tok, EngineConfig(n_slots=1, n_ctx=backend.n_ctx, n_batch=512, spec=spec),
                    drafters=drafters)
    req = CompletionRequest(prompt, n_predict=n_predict, sampling=SamplingParams(temperature=0.0), ignore_eos=True)

    async def go() -> FinalEvent:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            final = await engine.submit(req).result()
            tg.cancel_scope.cancel()
        return final

    cpu0 = time.process_time()
    try:
        final = anyio.run(go)
    finally:
        engine.close()
    if final.error:
        raise SystemExit(f"bench: {final.error}")
    cpu_per_token = (time.process_time() - cpu0) / max(len(final.tokens), 1)
    return final, engine.request_stats[final.request_id]["spec"].mean_len, cpu_per_token


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--lengths", default="1.5,2,3,4")
    ap.add_argument("--n-max", default="4,8")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("-t", "--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared CPU)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each forward-cost measurement")
    ap.add_argument("--fast", action="store_true", help="the backend's non-exact (unpadded) mode")
    args = ap.parse_args(argv)
    path = args.model
    if path is None:
        from spekula.frontends.default_model import ensure_default_model

        path = str(ensure_default_model())
    tok = Tokenizer.from_gguf(GGUFFile(path))
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    backend = load_backend("torch", path, BackendOptions(device=args.device, dtype=args.dtype, n_ctx=512,
                                                          n_seq_max=2, threads=args.threads, exact=not args.fast))
    n_maxes = [int(v) for v in args.n_max.split(",")]
    lengths = [float(v) for v in args.lengths.split(",")]
    fill_token = next(t for t in range(tok.n_vocab) if not tok.is_eog(t))

    run_once(backend, tok, prompt, 4, SpecParams(), [])  # warm-up (allocations, kernels)
    # Measured from a worker thread, like the engine's forwards.
    rows = sorted({1, *(k + 1 for k in n_maxes)})
    costs = anyio.run(anyio.to_thread.run_sync, forward_costs, backend, prompt, rows, args.reps)
    print(f"model {backend.info.name} on {args.device}/{args.dtype} (exact={not args.fast}), "
          f"prompt {len(prompt)} tokens, n_predict {args.n_predict}")
    for n, t in costs.items():
        print(f"forward cost: {n:2d} rows = {t * 1e3:8.2f} CPU ms ({t / costs[1]:.2f}x a 1-row forward)")

    plain, _, plain_cpu = run_once(backend, tok, prompt, args.n_predict, SpecParams(), [])
    base = plain.timings["predicted_per_second"]
    print(f"plain: {base:8.2f} tokens/s wall, {1e3 * plain_cpu:.1f} CPU ms/token "
          f"(a bare 1-row forward: {costs[1] * 1e3:.1f} CPU ms)")
    print("speedup: wall-clock tokens/s ratio | cpu: CPU-time per token ratio (robust to a loaded machine)")
    print("predicted = L * t(1 row) / t(n_max+1 rows), from the asked and from the measured L")
    print(f"{'n_max':>5} {'L asked':>7} {'L meas':>6} {'tokens/s':>9} {'speedup':>8} {'cpu':>6} "
          f"{'pred(asked)':>11} {'pred(meas)':>10}")
    for n_max in n_maxes:
        for length in lengths:
            if length > n_max + 1:
                continue
            spec = SpecParams(types=("bench-fill",), n_max=n_max, synth_len=length)
            final, measured_len, cpu = run_once(backend, tok, prompt, args.n_predict, spec,
                                                [FillDrafter(n_max, fill_token)])
            t = final.timings
            ratio = costs[1] / costs[n_max + 1]
            print(f"{n_max:5d} {length:7.2f} {measured_len:6.2f} {t['predicted_per_second']:9.2f} "
                  f"{t['predicted_per_second'] / base:7.2f}x {plain_cpu / cpu:5.2f}x "
                  f"{length * ratio:10.2f}x {measured_len * ratio:9.2f}x")
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
