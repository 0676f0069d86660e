"""How much a drafter of a given quality can speed decoding up on this machine, measured in one run.

    .venv/bin/python bench/spec.py [-m MODEL] [--backend native] [-t 2] [-n 128] [--reps 3]
                                   [--lengths 1.5,2,2.5,3] [--at 6] [--n-max 1,2,3,4,6]
                                   [--call-ms 0] [--step-ms 0]

A drafter is described by its mean acceptance length L at a cap of `--at` tokens (target token
included, as the statistics line counts it) and by what one call costs (`--call-ms` for a call's
first token, `--step-ms` for each further one). Acceptance is synthetic (`--spec-synth-rates`): each
draft position is accepted with the same conditional probability p, chosen so that full drafts of
`--at` tokens average L; a bench-local drafter proposes filler tokens and spins for its call cost.
So the engine runs every real round (drafting, a verification forward of k+1 rows, bookkeeping)
while the target's answer is left out of the question: the generated text is not valid output.

For every L and call cost the engine decodes at each fixed cap k in `--n-max` (each keeps the rates
of the first k positions) and plain, the repetitions alternating, and the table gives the median
ratio of decode tokens/s to plain decoding of the same repetition. The best cap's ratio is the most
a drafter of that quality and cost can give here with chain drafts and any length rule: rounds of k
tokens at rate p are what an adaptive planner chooses from. The forward-cost lines show where it
comes from: a round of k drafts costs a forward of k+1 rows, and on a CPU each row beyond the first
adds a share of a one-row forward (on a GPU close to nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import anyio
import numpy as np

from spekula.core.backend import Backend, BackendOptions, SeqInput, load_backend
from spekula.core.drafting.drafter import Draft, DrafterContext, DraftlessDrafter, DraftRequest
from spekula.core.engine.engine import Engine, EngineConfig
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

PROMPT = "I have a job interview tomorrow for a junior developer role. Any advice?"


class FillDrafter(DraftlessDrafter):
    """Proposes n_max copies of a fixed non-EOG token and spins for a call's cost: only lengths matter here."""

    name: ClassVar[str] = "bench-fill"

    def __init__(self, n_max: int, token: int, call_s: float = 0.0, step_s: float = 0.0) -> None:
        self.n_max = n_max
        self.draft_cap = n_max  # the engine sizes synthetic rates and tables by it
        self.token = token
        self.call_s = call_s
        self.step_s = step_s

    @classmethod
    def create(cls, ctx: DrafterContext) -> FillDrafter:
        return cls(ctx.spec.n_max, 0)

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = [Draft([self.token] * min(self.n_max, r.n_max)) for r in requests]
        steps = max((len(d.tokens) for d in drafts), default=0)
        if steps:
            # A busy wait, not a sleep: a head's call keeps a core busy, and sleeping would let
            # the CPU clock down between forwards.
            until = time.perf_counter() + self.call_s + self.step_s * (steps - 1)
            while time.perf_counter() < until:
                pass
        return drafts

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None


def forward_costs(backend: Backend, prompt: list[int], rows: list[int], reps: int) -> dict[int, float]:
    """Median seconds of one forward of `rows` new tokens after the prompt, every row with logits."""
    seq = backend.new_seq()
    backend.forward([SeqInput(seq, np.asarray(prompt, np.int32), 0)])
    times: dict[int, list[float]] = {n: [] for n in rows}
    for _ in range(reps):
        for n in rows:
            toks = np.full(n, 0, dtype=np.int32)
            backend.checkpoint(seq)  # a recurrent model comes back to the prompt from here (untimed: it is O(1))
            t0 = time.perf_counter()
            backend.forward([SeqInput(seq, toks, len(prompt), np.arange(n))])
            times[n].append(time.perf_counter() - t0)
            backend.truncate(seq, len(prompt))
    backend.free_seq(seq)
    return {n: statistics.median(v) for n, v in times.items()}


def run_alone(engine: Engine, req: CompletionRequest) -> Any:
    """`req` alone on `engine` (started here, closed after): its final event."""

    async def go() -> object:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            final = await engine.submit(req).result()
            tg.cancel_scope.cancel()
        return final

    try:
        return anyio.run(go)
    finally:
        engine.close()


def decode_rate(backend: Backend, tok: Tokenizer, prompt: list[int], n_predict: int, spec: SpecParams,
                drafters: list[object]) -> tuple[float, float]:
    """One request on a fresh engine: its decode tokens/s and mean acceptance length."""
    engine = Engine(backend, tok, EngineConfig(n_slots=1, n_ctx=backend.n_ctx, n_batch=512, spec=spec),
                    drafters=drafters)
    req = CompletionRequest(prompt, n_predict=n_predict, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    final = run_alone(engine, req)
    if final.error:  # type: ignore[attr-defined]
        raise SystemExit(f"bench: {final.error}")  # type: ignore[attr-defined]
    stats = engine.request_stats[final.request_id]["spec"]  # type: ignore[attr-defined]
    return final.timings["predicted_per_second"], stats.mean_len  # type: ignore[attr-defined]


def geometric_p(length: float, at: int) -> float:
    """The conditional acceptance p with 1 + p + p^2 + ... + p^at = length (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if sum(mid**j for j in range(1, at + 1)) < length - 1.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def predicted_best(p: float, n_maxes: Sequence[int], costs: dict[int, float], call_s: float, step_s: float) -> float:
    """The best cap's speed-up from the forward costs alone: a round of k drafts emits 1 + p + ... + p^k
    tokens on average and costs a (k+1)-row forward plus the call; plain decoding a 1-row forward a token.
    (Engine time around the forwards is left out on both sides.)"""
    best = 0.0
    for k in n_maxes:
        tokens = sum(p**j for j in range(k + 1))
        best = max(best, tokens * costs[1] / (costs[k + 1] + call_s + step_s * (k - 1)))
    return best


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--backend", default="native", help="native (default), torch or onnx")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="alternating repetitions of every configuration")
    ap.add_argument("--lengths", default="1.5,2,2.5,3", help="mean acceptance lengths L at the cap --at")
    ap.add_argument("--at", type=int, default=6, help="the cap at which L is the mean acceptance length")
    ap.add_argument("--n-max", default="1,2,3,4,6", help="fixed caps to decode with")
    ap.add_argument("--call-ms", default="0", help="costs of a call's first draft token, ms (comma list)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="cost of each further draft token in a call, ms")
    ap.add_argument("--prompt", default=PROMPT, help="user message (chat-templated)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = args.model
    if path is None:
        from spekula.backends.gguf.default_model import ensure_default_model

        path = str(ensure_default_model())
    tok = Tokenizer.from_gguf(GGUFFile(path))
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]))
    n_maxes = sorted({int(v) for v in args.n_max.split(",")})
    lengths, calls = floats(args.lengths), floats(args.call_ms)
    if min(n_maxes) < 1 or any(not 1.0 <= L <= args.at + 1 for L in lengths):
        raise SystemExit("bench: caps must be >= 1 and each length within [1, --at + 1]")
    backend = load_backend(args.backend, path, BackendOptions(device=args.device, n_ctx=len(prompt) + args.n_predict
                                                              + max(n_maxes) + 64, n_seq_max=2,
                                                              threads=args.threads))
    fill_token = next(t for t in range(tok.n_vocab) if not tok.is_eog(t))

    decode_rate(backend, tok, prompt, 8, SpecParams(), [])  # warm-up: allocations, kernels
    rows = sorted({1, *(k + 1 for k in n_maxes)})
    costs = anyio.run(anyio.to_thread.run_sync, forward_costs, backend, prompt, rows, 9)
    print(f"model {backend.info.name}, backend {args.backend} on {args.device}, {args.threads} thread(s), "
          f"prompt {len(prompt)} tokens, n_predict {args.n_predict}, {args.reps} alternating repetitions")
    for n, t in costs.items():
        print(f"forward of {n:2d} rows after the prompt: {t * 1e3:6.2f} ms ({t / costs[1]:.2f}x one row)")

    configs: list[tuple[float, float, int]] = [(L, c, k) for L in lengths for c in calls for k in n_maxes]
    ratios: dict[tuple[float, float, int], list[float]] = {cfg: [] for cfg in configs}
    measured: dict[tuple[float, float, int], list[float]] = {cfg: [] for cfg in configs}
    plain_rates: list[float] = []
    for _ in range(args.reps):
        plain, _ = decode_rate(backend, tok, prompt, args.n_predict, SpecParams(), [])
        plain_rates.append(plain)
        for L, c, k in configs:
            p = geometric_p(L, args.at)
            rates = tuple(p ** (j + 1) for j in range(k))
            spec = SpecParams(types=("bench-fill",), n_max=k, synth_rates=rates, adaptive=False)
            drafter = FillDrafter(k, fill_token, c / 1e3, args.step_ms / 1e3)
            rate, mean_len = decode_rate(backend, tok, prompt, args.n_predict, spec, [drafter])
            ratios[(L, c, k)].append(rate / plain)
            measured[(L, c, k)].append(mean_len)
    backend.close()

    print(f"plain decoding: {statistics.median(plain_rates):.1f} tok/s (median)")
    print(f"x plain (median of {args.reps}); in brackets the measured mean acceptance length; 'forwards': the best "
          "cap's speed-up predicted from the forward costs above and the call cost alone")
    for c in calls:
        print(f"\ncall cost {c:g} ms + {args.step_ms:g} ms per further draft token")
        print(f"{'L at ' + str(args.at):>8} {'p':>6} " + " ".join(f"{'cap ' + str(k):>15}" for k in n_maxes)
              + f" {'best':>12} {'forwards':>9}")
        for L in lengths:
            cells = {k: statistics.median(ratios[(L, c, k)]) for k in n_maxes}
            best = max(cells, key=lambda k: cells[k])
            row = " ".join(f"{cells[k]:6.2f}x ({statistics.median(measured[(L, c, k)]):5.2f})" for k in n_maxes)
            model = predicted_best(geometric_p(L, args.at), n_maxes, costs, c / 1e3, args.step_ms / 1e3)
            print(f"{L:8.2f} {geometric_p(L, args.at):6.3f} {row} {cells[best]:6.2f}x cap {best} {model:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
