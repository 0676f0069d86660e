"""Adaptive draft lengths against fixed ones and plain decoding, on SmolLM2, in one run.

    .venv/bin/python bench/adaptive.py [-m MODEL.gguf] [-n 128] [--reps 3] [--threads 2]
                                       [--parts single,sweep,editing,server] [--quick]

Part "single" (one stream, the default native backend, greedy): for code rewrite, repeat-then-
summarise and four open-ended chat prompts, plain decoding vs `ngram-mod,ngram-simple` and `suffix`,
each with fixed lengths (`--spec-adaptive off`) and adaptive ones. Every configuration runs --reps
times in an order that rotates between repetitions, each run on a fresh engine (no drafter state
carried over); a ratio is the median over repetitions of tok/s over the plain tok/s of the same
repetition (this machine's speed drifts by tens of percent from one minute to the next); the
open-ended chats, whose runs are short and whose goal has a 3 % margin, run --chat-reps times. Part "sweep": for the two repetitive workloads, fixed lengths with the drafters' caps set to
4, 8, 16, 32 and 64 (ngram-simple size-m, ngram-mod n-max, suffix n-max), and adaptive lengths with
their default caps against the best of them (also held out: the cap chosen on the even repetitions,
adaptive scored against it on the odd ones). Part "editing": a file edited in 5 successive requests
(each returns the whole file; the next request edits that answer), on one engine per configuration
so drafter state carries between turns as on a server: plain, every n-gram type, their pair and
`suffix`, each with fixed and adaptive lengths, --edit-reps times in rotating order. Part "server": a `spekula serve` process, -np 4, 8 clients (bench/serve_load.py's
prompts and checks), no speculation vs ngram-mod fixed vs ngram-mod adaptive, per-request settings
on the same server, each phase run --server-reps times in rotating order. Every answer is checked against plain decoding; a mismatch fails the run.

Goals: chat >= 0.97x plain; repetitive workloads >= 0.95x the best fixed cap; server load with
speculation >= 1.0x no speculation; suffix ahead of every n-gram type on the editing workload.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ is not a package
from ngram import _CODE, WORKLOADS  # noqa: E402

CHATS = {
    "chat": WORKLOADS["chat"],
    "chat-advice": "I have a job interview tomorrow for a junior developer role. Any advice?",
    "chat-explain": "Explain how a rainbow forms, as if I were ten years old.",
    "chat-poem": "Write a poem about autumn in a quiet city.",
}
SINGLE = {"code-rewrite": WORKLOADS["code-rewrite"], "repeat-summarise": WORKLOADS["repeat-summarise"], **CHATS}
REPETITIVE = ("code-rewrite", "repeat-summarise")
PAIR = ("ngram-mod", "ngram-simple")
CAPS = (4, 8, 16, 32, 64)
EDITS = [
    "Rename the variable `total` to `grand_total`.",
    "Rename `per_customer` to `by_customer`.",
    "Change the default `tax_rate` from 0.2 to 0.25.",
    "Rename the list `skipped` to `missing`.",
    "Rename the function to `summarise_orders`.",
]
N_CTX = 4096


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per single-stream request")
    p.add_argument("--edit-n-predict", type=int, default=640, help="token cap per editing turn")
    p.add_argument("--edit-reps", type=int, default=2, help="repetitions of the editing workload per configuration")
    p.add_argument("--reps", type=int, default=9, help="repetitions per single-stream configuration")
    p.add_argument("--chat-reps", type=int, default=21,
                   help="repetitions per configuration on the open-ended chats (short runs, a 3 %% margin)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="native")
    p.add_argument("--parts", default="single,sweep,editing,server")
    p.add_argument("--quick", action="store_true", help="-n 32, 1 repetition, a short server phase: a smoke run")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=12, help="server part: requests per client and phase run")
    p.add_argument("--server-reps", type=int, default=3, help="server part: runs of each phase, rotating")
    args = p.parse_args(argv)
    if args.quick:
        args.n_predict, args.reps, args.requests, args.edit_n_predict = min(args.n_predict, 32), 1, 2, 96
        args.server_reps = args.edit_reps = args.chat_reps = 1
    return args


class Bench:
    """One backend; a fresh engine per measured configuration."""

    def __init__(self, args: argparse.Namespace) -> None:
        from spekula.core.backend import BackendOptions, load_backend
        from spekula.core.modelfile.gguf_file import GGUFFile
        from spekula.core.modelfile.tokenizer import Tokenizer

        self.args = args
        self.model = args.model or self._default_model()
        self.backend = load_backend(args.backend, self.model,
                                    BackendOptions(n_ctx=N_CTX, n_seq_max=1, threads=args.threads))
        self.tokenizer = Tokenizer.from_gguf(GGUFFile(self.model))
        self.failures: list[str] = []

    @staticmethod
    def _default_model() -> str:
        from spekula.backends.gguf.default_model import ensure_default_model

        return str(ensure_default_model())

    def chat_prompt(self, text: str) -> list[int]:
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return [int(t) for t in self.tokenizer.encode(rendered, add_special=True, parse_special=True)]

    def session(self, types: tuple[str, ...], adaptive: bool, options: dict[str, Any],
                prompts: Callable[[list[int] | None], list[int] | None], n_predict: int) -> list[Any]:
        """Run requests on one fresh engine: `prompts(previous answer tokens)` gives the next prompt
        (None: done). Returns the final events."""
        import anyio

        from spekula.core.engine.engine import Engine, EngineConfig
        from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

        spec = SpecParams(types=types, adaptive=adaptive, drafter_options=dict(options))
        engine = Engine(self.backend, self.tokenizer, EngineConfig(n_slots=1, n_ctx=N_CTX, spec=spec),
                        backend_name=self.args.backend)
        finals: list[Any] = []

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                previous: list[int] | None = None
                while (prompt := prompts(previous)) is not None:
                    final = await engine.submit(CompletionRequest(prompt, n_predict=n_predict,
                                                                  sampling=SamplingParams(temperature=0.0))).result()
                    if final.error:
                        raise RuntimeError(final.error)
                    finals.append(final)
                    previous = [int(t) for t in final.tokens]
                tg.cancel_scope.cancel()

        try:
            anyio.run(run)
        finally:
            engine.close()
        return finals

    def one(self, prompt: list[int], types: tuple[str, ...], adaptive: bool, options: dict[str, Any]) -> Any:
        return self.session(types, adaptive, options, lambda prev: prompt if prev is None else None,
                            self.args.n_predict)[0]

    def check(self, label: str, got: list[int], want: list[int]) -> str:
        if got == want:
            return "yes"
        self.failures.append(label)
        return "NO"


def caps_options(cap: int | None) -> dict[str, Any]:
    """Drafter options setting every drafter's length cap to `cap` (None: the defaults)."""
    if cap is None:
        return {}
    return {"spec-ngram-simple-size-m": cap, "spec-ngram-mod-n-max": cap, "spec-ngram-mod-n-min": min(48, cap),
            "spec-suffix-n-max": cap}


def reps_for(args: argparse.Namespace, workload: str) -> int:
    """Repetitions of each configuration on a workload: the open-ended chats get more, because a run
    of one is short (70-128 tokens, half a second) and its goal's margin is smaller than one run's noise."""
    return max(getattr(args, "chat_reps", args.reps), args.reps) if workload in CHATS else args.reps


def measure(bench: Bench, workloads: dict[str, str], configs: dict[str, tuple[tuple[str, ...], bool, dict[str, Any]]]
            ) -> dict[str, dict[str, Any]]:
    """Median tok/s per (workload, config) over --reps rotating repetitions, plus plain's."""
    all_configs = {"plain": ((), False, {}), **configs}
    names = list(all_configs)
    out: dict[str, dict[str, Any]] = {}
    for wname, text in workloads.items():
        prompt = bench.chat_prompt(text)
        bench.one(prompt[:32], (), False, {})  # warm-up
        tps: dict[str, list[float]] = {n: [] for n in names}
        finals: dict[str, Any] = {}
        for rep in range(reps_for(bench.args, wname)):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for name in order:
                types, adaptive, options = all_configs[name]
                final = bench.one(prompt, types, adaptive, options)
                tps[name].append(final.timings["predicted_per_second"])
                finals[name] = final
        plain = finals["plain"]
        row: dict[str, Any] = {"prompt_n": len(prompt), "n": len(plain.tokens)}
        for name in names:
            f = finals[name]
            row[name] = {
                "tps": statistics.median(tps[name]),
                # The machine's speed drifts between minutes: each repetition's ratio is taken against
                # the plain run of the same repetition, and the median of those is reported.
                "ratios": (ratios := [a / b for a, b in zip(tps[name], tps["plain"], strict=True)]),
                "ratio": statistics.median(ratios),
                "same": bench.check(f"{wname}/{name}", list(f.tokens), list(plain.tokens)),
                "draft_n": f.timings.get("draft_n", 0), "draft_n_accepted": f.timings.get("draft_n_accepted", 0),
            }
        out[wname] = row
    return out


def print_table(title: str, results: dict[str, dict[str, Any]], names: list[str]) -> None:
    print(f"\n## {title}\n")
    print("| workload | plain tok/s | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for wname, row in results.items():
        base = row["plain"]["tps"]
        cells = []
        for n in names:
            r = row[n]
            acc = f", acc {r['draft_n_accepted']}/{r['draft_n']}" if r["draft_n"] else ""
            same = "" if r["same"] == "yes" else " **OUTPUT DIFFERS**"
            cells.append(f"{r['ratio']:.2f}x ({r['tps']:.0f}{acc}){same}")
        print(f"| {wname} | {base:.1f} | " + " | ".join(cells) + " |")


def part_single(bench: Bench) -> dict[str, dict[str, Any]]:
    configs = {
        "pair fixed": (PAIR, False, {}), "pair adaptive": (PAIR, True, {}),
        "suffix fixed": (("suffix",), False, {}), "suffix adaptive": (("suffix",), True, {}),
    }
    results = measure(bench, SINGLE, configs)
    print_table(f"One stream, greedy, n_predict {bench.args.n_predict}, median of {bench.args.reps} "
                f"(open-ended chats: {reps_for(bench.args, 'chat')}) (x plain of the same rounds)", results, list(configs))
    return results


def held_out(label: str, n_reps: int, ratio: Callable[[str, range], float], digits: int = 2) -> str:
    """The fixed cap chosen on the even repetitions, and adaptive over it on the odd ones: the best of
    five noisy cells scored on the same runs is favoured by the noise that made it look best.
    `ratio(config, reps)` is a configuration's speed over plain's on those repetitions."""
    if n_reps < 2:
        return "needs --reps >= 2"
    choose, score = range(0, n_reps, 2), range(1, n_reps, 2)
    best = max(CAPS, key=lambda c: ratio(f"{label} fixed {c}", choose))
    return f"{best}: **{ratio(f'{label} adaptive', score) / ratio(f'{label} fixed {best}', score):.{digits}f}x**"


def part_sweep(bench: Bench) -> dict[str, dict[str, Any]]:
    configs: dict[str, tuple[tuple[str, ...], bool, dict[str, Any]]] = {}
    for cap in CAPS:
        configs[f"pair fixed {cap}"] = (PAIR, False, caps_options(cap))
        configs[f"suffix fixed {cap}"] = (("suffix",), False, caps_options(cap))
    configs["pair adaptive"] = (PAIR, True, {})
    configs["suffix adaptive"] = (("suffix",), True, {})
    results = measure(bench, {w: SINGLE[w] for w in REPETITIVE}, configs)
    print_table("Sweep of fixed caps on the repetitive workloads", results, list(configs))
    print("\n| workload | drafters | best fixed cap | best fixed x plain | adaptive x plain | adaptive / best fixed "
          "| held out: cap chosen on even repetitions, adaptive / it on odd ones |")
    print("|---|---|---|---|---|---|---|")
    for wname, row in results.items():
        for label in ("pair", "suffix"):
            best = max(CAPS, key=lambda c: row[f"{label} fixed {c}"]["ratio"])
            b, a = row[f"{label} fixed {best}"]["ratio"], row[f"{label} adaptive"]["ratio"]
            view = held_out(label, len(row["plain"]["ratios"]),
                            lambda name, reps, row=row: statistics.median(row[name]["ratios"][r] for r in reps))
            print(f"| {wname} | {label} | {best} | {b:.2f}x | {a:.2f}x | **{a / b:.2f}x** | {view} |")
    return results


def part_editing(bench: Bench) -> dict[str, float]:
    """Five successive edits of one file; each turn's prompt holds the previous answer."""
    def turns() -> Callable[[list[int] | None], list[int] | None]:
        state = {"turn": 0, "file": _CODE}

        def next_prompt(previous: list[int] | None) -> list[int] | None:
            if previous is not None:
                state["file"] = bench.tokenizer.decode(previous, skip_special=True)
            i = state["turn"]
            if i == len(EDITS):
                return None
            state["turn"] += 1
            return bench.chat_prompt(f"{EDITS[i]} Return the whole file.\n\n{state['file']}")
        return next_prompt

    drafters: dict[str, tuple[str, ...]] = {
        **{t: (t,) for t in ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")},
        "ngram-mod,ngram-simple": PAIR, "suffix": ("suffix",)}
    configs: dict[str, tuple[tuple[str, ...], bool]] = {"plain": ((), False)}
    for name, types in drafters.items():
        configs[f"{name} fixed"] = (types, False)
        configs[f"{name} adaptive"] = (types, True)
    names = list(configs)
    tps: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[int]] = {}
    detail: dict[str, str] = {}
    for rep in range(bench.args.edit_reps):  # rotating order: the machine's speed drifts
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            types, adaptive = configs[name]
            finals = bench.session(types, adaptive, {}, turns(), bench.args.edit_n_predict)
            n = sum(len(f.tokens) for f in finals)
            tps[name].append(n / (sum(f.timings["predicted_ms"] for f in finals) / 1e3))
            tokens[name] = sum((list(f.tokens) for f in finals), [])
            drafted = sum(f.timings.get("draft_n", 0) for f in finals)
            accepted = sum(f.timings.get("draft_n_accepted", 0) for f in finals)
            detail[name] = f"{n} tokens in {len(finals)} turns, acc {accepted}/{drafted}"
    ratio = {n: statistics.median(a / b for a, b in zip(tps[n], tps["plain"], strict=True)) for n in names}
    print(f"\n## Multi-turn editing: {len(EDITS)} successive edits of one file, median of {bench.args.edit_reps}\n")
    print("| drafters | decode tok/s | x plain | same as plain | detail |")
    print("|---|---|---|---|---|")
    for name in names:
        same = bench.check(f"editing/{name}", tokens[name], tokens["plain"])
        print(f"| {name} | {statistics.median(tps[name]):.1f} | {ratio[name]:.2f}x | {same} | {detail[name]} |")
    for mode in ("fixed", "adaptive"):
        best = max((n for n in names if n.endswith(mode) and not n.startswith("suffix")), key=lambda n: ratio[n])
        print(f"\n{mode}: suffix / best n-gram ({best}): **{ratio['suffix ' + mode] / ratio[best]:.2f}x**")
    best_any = max((n for n in names if n != "plain" and not n.startswith("suffix")), key=lambda n: ratio[n])
    best_suffix = max(("suffix fixed", "suffix adaptive"), key=lambda n: ratio[n])
    print(f"best suffix ({best_suffix}) / best n-gram ({best_any}): **{ratio[best_suffix] / ratio[best_any]:.2f}x**")
    return ratio


def merge_phases(name: str, runs: list[Any]) -> Any:
    """The repetitions of one server phase as one (tokens and wall time summed)."""
    merged = runs[0].__class__(name)
    for r in runs:
        merged.latencies += r.latencies
        merged.errors += r.errors
        for f in ("tokens", "ok", "wrong", "lost", "skipped", "wall"):
            setattr(merged, f, getattr(merged, f) + getattr(r, f))
    return merged


def part_server(bench: Bench) -> None:
    import os
    import signal
    import subprocess
    import tempfile

    from serve_load import make_prompts, report, run_phase, wait_for_socket

    from spekula.frontends.rpc.client import SpekulaClient

    args = argparse.Namespace(time_limit=1800.0, requests=bench.args.requests, n_predict=16,
                              clients=bench.args.clients)
    prompts = make_prompts(8)
    with tempfile.TemporaryDirectory() as tmp:
        sock, log = os.path.join(tmp, "bench.sock"), Path(tmp) / "server.log"
        cmd = [sys.executable, "-m", "spekula.frontends.cli.main", "serve", "-m", bench.model, "--socket", sock,
               "-np", "4", "-c", "1024", "--temp", "0", "-t", str(bench.args.threads), "--spec-type", "ngram-mod",
               "--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-min", "4", "--spec-ngram-mod-n-max", "16"]
        print("\n## Server load: " + " ".join(cmd[2:]).replace(sock, "SOCK") + f", {args.clients} clients x "
              f"{args.requests} requests per phase\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
        try:
            if not wait_for_socket(proc, sock, log):
                bench.failures.append("server did not start")
                return
            with SpekulaClient(sock, timeout=600) as c:
                refs = {p: c.completion(p, n_predict=16, return_tokens=True, speculative={"type": "none"})["tokens"]
                        for p in prompts}
            settings = [("no-spec", {"type": "none"}), ("fixed", {"adaptive": False}), ("adaptive", {"adaptive": True})]
            runs: dict[str, list[Any]] = {name: [] for name, _ in settings}
            for rep in range(bench.args.server_reps):  # rotating order: the machine's speed drifts
                for name, spec in settings[rep % 3:] + settings[: rep % 3]:
                    runs[name].append(run_phase(name, sock, prompts, refs, args, spec))
            phases = [merge_phases(name, runs[name]) for name, _ in settings]
            print("```")
            report([phases[0], phases[1]])
            report([phases[0], phases[2]])
            print("```")
            for ph in phases:
                if ph.wrong or ph.lost:
                    bench.failures.append(f"server/{ph.name}: {ph.wrong} wrong, {ph.lost} lost")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    print(f"model {Path(bench.model).name}, backend {args.backend}, {args.threads} threads, greedy")
    parts = args.parts.split(",")
    if "single" in parts:
        part_single(bench)
    if "sweep" in parts:
        part_sweep(bench)
    if "editing" in parts:
        part_editing(bench)
    bench.backend.close()
    if "server" in parts:
        part_server(bench)
    if bench.failures:
        print("\nFAIL: " + ", ".join(bench.failures))
        return 1
    print("\nOK: every output equals plain decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
