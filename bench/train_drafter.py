"""Trained EAGLE-3 and DFlash draft heads on SmolLM2, against plain decoding and the n-gram drafters.

    .venv/bin/python bench/train_drafter.py [-n 128] [--prompts 8] [-t 2] [--quick] [-m MODEL.gguf]
                                            [--eagle3 FILE] [--dflash FILE] [--backend auto] [--torch-runtime]
                                            [--llama-server PATH | --no-llama-server]
                                            [--rows eagle3,dflash,...] [--modes fixed,adaptive] [--chat-only]

The prompts are `--prompts` held-out built-in prompts (`spekula.training.prompts.builtin_prompts(N,
split="heldout")`: no topic and no template in common with the prompts the heads were trained on,
about a fifth of them code tasks) and four open-ended chat prompts written here; the run refuses to
start if any of them is among the first 2000 training prompts. Each is rendered through the model's
chat template and generated greedily, `-n` tokens at most, by spekula's Engine on one shared target
backend in one process: plain decoding, then `draft-eagle3 -md EAGLE3.gguf`, `draft-dflash -md
DFLASH.gguf`, `ngram-simple` and `ngram-mod`, each with `--spec-draft-n-max 6` (the n-gram drafters'
own caps, size-m and n-min/n-max, are set to 6 too) twice: with the adaptive planner off (a fixed
n_max 6 every round, as llama.cpp drafts: this is the "mean acceptance length at n_max 6") and on
(spekula's default: what a user gets). Beside a native target both heads run on the native kernels;
`--torch-runtime` adds `eagle3/torch` and `dflash/torch` rows with the heads on torch (`--spec-draft-dtype
f32`), for comparison. A DFlash head drafts at most block_size - 1 tokens a round; its runtime
clamps a larger n_max and says so. Every run gets a fresh engine, so no drafter state (the ngram-mod
pool, the planner's cost model) carries from one run to the next. For each prompt a
plain run comes before the first drafter's pair of runs and after every pair; a pair's speed is
compared with the two plain runs that bracket it, so slow drift in the machine's load cancels.
Every output is checked token for token against plain decoding (greedy speculation is lossless);
any difference makes the exit status 1. Unmet goals do not: this is a measurement.

The heads default to the ones shipped for the target (drafters/model/shipped_heads.py); a missing head
skips its rows and says why. With `--also-shipped`, heads given by --eagle3/--dflash run beside the
shipped ones (rows `<kind>/shipped`), so a new training run is compared with the heads it would
replace on the same prompts in one run. When a llama-server binary is found (bench/llama_server.py: --llama-
server PATH, else $SPEKULA_LLAMA_SERVER, else PATH), the same prompt ids also go to
llama-server with the same head files (`--spec-type draft-eagle3|draft-dflash -md FILE
--spec-draft-n-max 6`, greedy), one server per configuration, requests interleaved with its own
plain server's, and its acceptance and speed-up are printed next to spekula's fixed-n_max rows.
llama-server's outputs are compared with its own plain outputs and reported, not failed on; a
head it refuses or crashes on is reported with its error lines. On a loaded 2-core machine its
spinning thread barriers can make it crawl at -t 2 (see bench/ngram.py); its ratio is still against
its own plain runs.

Columns: acc rate = accepted / drafted tokens; mean len = tokens emitted per verification round
(1 + accepted / rounds, llama.cpp's "mean acc len"; the n_predict remainder caps the last rounds, so
even a perfect draft shows a little under 7); full = rounds that accepted all 6 draft tokens; tok/s =
decode tokens per wall second (the engine's predicted_ms); x plain = tok/s over the bracketing plain
runs; chat x = the same over the open-ended chat prompts only (the goal's workload); cpu x = plain
process-CPU seconds per token over this row's (prompt included; steadier than wall time on a
loaded machine); med x / med chat = the median over prompts of each run's tok/s over its bracketing
plain runs' (all prompts / chat only: one run slowed by another process's burst moves it little). Goals: EAGLE-3 mean len >= 2.5 and DFlash >= 2.0 at fixed n_max 6; decode speed-up
>= 1.3x on open-ended chat for the best trained head (the best of both heads and both planner
settings), each printed as met or NOT met.

Full run (12 prompts x 13 generations of up to 128 tokens, then llama-server's 12 x 3; run it on
an otherwise idle machine):
    .venv/bin/python bench/train_drafter.py -n 128 --prompts 8 -t 2
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ is not a package
from adaptive import caps_options  # noqa: E402
from draft_model import Run, Tally  # noqa: E402
from llama_server import (  # noqa: E402
    MAX_REQUESTS,
    Completion,
    LlamaServer,
    LlamaServerError,
    find_llama_server,
    supported_spec_types,
)

N_MAX = 6
GOAL_LEN = {"eagle3": 2.5, "dflash": 2.0}  # mean acceptance length at fixed n_max 6
GOAL_CHAT_SPEEDUP = 1.3
HAND_WRITTEN = (
    "My neighbour keeps parking in front of my driveway. How can I bring it up without starting a feud?",
    "Plan a relaxed three-day trip to Lisbon for someone who loves food and old bookshops.",
    "What is the difference between weather and climate, and why do people mix them up?",
    "I want to start running but I get bored quickly. What are some ways to keep it interesting?",
)
HEAD_KINDS = ("eagle3", "dflash")
MODES = ("fixed", "adaptive")


@dataclass(frozen=True, slots=True)
class Prompt:
    name: str
    chat: bool  # open-ended chat (the speed-up goal's workload), not a code task
    ids: list[int]


@dataclass(frozen=True, slots=True)
class Drafter:
    """One table row's drafter: its spec types, -md file (trained heads) and drafter options."""

    label: str
    types: tuple[str, ...]
    head: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    draft_dtype: str | None = None  # --spec-draft-dtype (f32: the torch head runtime beside a native target)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--n-predict", type=int, help="tokens per generation (default 128)")
    p.add_argument("--prompts", type=int, help="held-out built-in prompts (default 8; the 4 hand-written ones come on top)")
    p.add_argument("-t", "--threads", type=int, default=2, help="threads of the target and the draft runtimes (default 2)")
    p.add_argument("--backend", default="auto", help="target backend (default auto: native on the CPU)")
    p.add_argument("--eagle3", metavar="FILE", help="EAGLE-3 head GGUF (default: the one shipped for the target)")
    p.add_argument("--dflash", metavar="FILE", help="DFlash head GGUF (default: the one shipped for the target)")
    p.add_argument("--llama-server", metavar="PATH", help="llama-server binary (default: $SPEKULA_LLAMA_SERVER, then PATH)")
    p.add_argument("--no-llama-server", action="store_true", help="skip the llama-server comparison")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts (1 held-out, 1 hand-written), -n 24")
    p.add_argument("--training-prompts", action="store_true",
                   help="the first --prompts training prompts instead of held-out and hand-written ones: how much of a "
                   "head's acceptance comes from fitting its own training prompts (the goals are not judged on them)")
    p.add_argument("--torch-runtime", action="store_true",
                   help="add rows with each head on the torch runtime (--spec-draft-dtype f32) beside the native one")
    p.add_argument("--also-shipped", action="store_true",
                   help="with --eagle3/--dflash: add rows for the shipped head of the same kind (<kind>/shipped)")
    p.add_argument("--rows", metavar="LABELS",
                   help="comma-separated row labels to run (e.g. eagle3,dflash; default: every row)")
    p.add_argument("--modes", default=",".join(MODES), metavar="MODES",
                   help="comma-separated planner settings to run, of fixed,adaptive (default both)")
    p.add_argument("--chat-only", action="store_true", help="only the open-ended chat prompts (no code tasks)")
    args = p.parse_args(argv)
    # Options given explicitly win over --quick's smaller defaults.
    n_predict, n_builtin, n_hand = (24, 1, 1) if args.quick else (128, 8, len(HAND_WRITTEN))
    args.n_predict = n_predict if args.n_predict is None else args.n_predict
    args.n_builtin = n_builtin if args.prompts is None else args.prompts
    args.n_hand = 0 if args.training_prompts else n_hand
    if args.n_predict < 1 or args.n_builtin < 0 or args.threads < 1:
        p.error("-n and -t must be >= 1, --prompts >= 0")
    args.modes = tuple(m for m in MODES if m in args.modes.split(","))
    if not args.modes:
        p.error(f"--modes: none of {','.join(MODES)}")
    return args


def make_prompts(tok: Any, n_builtin: int, n_hand: int, training: bool = False) -> list[Prompt]:
    """Held-out built-in prompts and the hand-written chats, rendered; none may be a training prompt
    (unless `training` asks for the first training prompts themselves)."""
    from spekula.training.prompts import builtin_prompts

    train_list = builtin_prompts(2000, split="train")
    if training:
        texts = [(f"train-{i}", "```" not in t, t) for i, t in enumerate(train_list[:n_builtin])]
    else:
        texts = [(f"heldout-{i}", "```" not in t, t) for i, t in enumerate(builtin_prompts(n_builtin, split="heldout"))]
    texts += [(f"hand-{i}", True, t) for i, t in enumerate(HAND_WRITTEN[:n_hand])]
    train = set(train_list)
    leaked = [name for name, _, t in texts if t in train and not training]
    if leaked:  # not an assert statement: python -O must not skip it
        raise AssertionError(f"prompts {leaked} are training prompts; held-out numbers would be wrong")
    prompts = []
    for name, chat, text in texts:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}])
        prompts.append(Prompt(name, chat, [int(t) for t in tok.encode(rendered, add_special=True, parse_special=True)]))
    return prompts


def find_heads(args: argparse.Namespace, model: str) -> dict[str, str]:
    """kind -> head file, printing why a kind has none."""
    from spekula.drafters.model.shipped_heads import find_shipped_head

    heads: dict[str, str] = {}
    for kind in HEAD_KINDS:
        given = getattr(args, kind)
        if given:
            if Path(given).is_file():
                heads[kind] = given
            else:
                print(f"{kind}: skipped, --{kind} {given} is not a file")
            continue
        shipped = find_shipped_head(model, kind)
        if shipped is None:
            print(f"{kind}: skipped, no shipped {kind} head for {Path(model).name} (train one with "
                  f"`spekula train-drafter {kind}`, or pass --{kind} FILE)")
        else:
            heads[kind] = str(shipped)
    for kind, path in heads.items():
        print(f"{kind}: {path}")
    return heads


def shipped_alternatives(args: argparse.Namespace, model: str, heads: dict[str, str]) -> dict[str, str]:
    """kind -> shipped head file, for the kinds whose head was given on the command line and differs."""
    from spekula.drafters.model.shipped_heads import find_shipped_head

    found: dict[str, str] = {}
    for kind in HEAD_KINDS:
        shipped = find_shipped_head(model, kind)
        if getattr(args, kind) and kind in heads and shipped is not None \
                and Path(shipped).resolve() != Path(heads[kind]).resolve():
            found[kind] = str(shipped)
            print(f"{kind}/shipped: {shipped}")
    return found


def drafter_rows(heads: dict[str, str], torch_runtime: bool = False,
                 shipped: dict[str, str] | None = None) -> list[Drafter]:
    ngram_caps = tuple(sorted(caps_options(N_MAX).items()))
    rows: list[Drafter] = []
    for kind in HEAD_KINDS:
        if kind in heads:
            rows.append(Drafter(kind, (f"draft-{kind}",), head=heads[kind]))
        if shipped and kind in shipped:
            rows.append(Drafter(f"{kind}/shipped", (f"draft-{kind}",), head=shipped[kind]))
    if torch_runtime:  # each head's row on torch, right after its native row
        for kind in reversed(HEAD_KINDS):
            if kind in heads:
                at = next(i for i, r in enumerate(rows) if r.label == kind) + 1
                rows.insert(at, Drafter(f"{kind}/torch", (f"draft-{kind}",), head=heads[kind], draft_dtype="f32"))
    return rows + [Drafter("ngram-simple", ("ngram-simple",), options=ngram_caps),
                   Drafter("ngram-mod", ("ngram-mod",), options=ngram_caps)]


class Target:
    """The one target backend; every generation runs on a fresh engine over it."""

    def __init__(self, args: argparse.Namespace, model: str, n_ctx: int) -> None:
        from spekula.core.backend import BackendOptions, load_backend, resolve_backend_name
        from spekula.core.modelfile.gguf_file import GGUFFile
        from spekula.core.modelfile.tokenizer import Tokenizer

        self.options = BackendOptions(n_ctx=n_ctx, n_seq_max=1, threads=args.threads)
        self.backend_name = resolve_backend_name(args.backend, self.options)
        self.backend = load_backend(self.backend_name, model, self.options)
        self.tokenizer = Tokenizer.from_gguf(GGUFFile(model))
        self.n_ctx = n_ctx

    def generate(self, drafter: Drafter | None, adaptive: bool, prompt: list[int], n_predict: int) -> Run:
        import anyio

        from spekula.core.engine.engine import Engine, EngineConfig
        from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

        spec = SpecParams() if drafter is None else SpecParams(
            types=drafter.types, n_max=N_MAX, adaptive=adaptive, drafter_options=dict(drafter.options))
        from dataclasses import replace

        draft_options = self.options if drafter is None or drafter.draft_dtype is None else \
            replace(self.options, dtype=drafter.draft_dtype)
        engine = Engine(self.backend, self.tokenizer, EngineConfig(n_slots=1, n_ctx=self.n_ctx, spec=spec),
                        backend_name=self.backend_name, draft_model_path=drafter.head if drafter else None,
                        draft_backend_options=draft_options)
        result: list[Run] = []

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                cpu0 = time.process_time()
                final = await engine.submit(CompletionRequest(prompt, n_predict=n_predict,
                                                              sampling=SamplingParams(temperature=0.0))).result()
                cpu = time.process_time() - cpu0
                if final.error:
                    raise SystemExit(f"bench: {drafter.label if drafter else 'plain'}: {final.error}")
                st = engine.request_stats[final.request_id]["spec"]
                full = st.histogram[N_MAX] if len(st.histogram) > N_MAX else 0
                result.append(Run([int(t) for t in final.tokens], final.timings["predicted_ms"] / 1e3, cpu,
                                  st.n_draft_tokens, st.n_draft_accepted, st.n_verif_steps, full))
                tg.cancel_scope.cancel()

        try:
            anyio.run(run)
        finally:
            engine.close()
        return result[0]

    def close(self) -> None:
        self.backend.close()


Rows = dict[tuple[str, str], Tally]


def bench_spekula(target: Target, drafters: list[Drafter], prompts: list[Prompt], n_predict: int,
                  modes: tuple[str, ...] = MODES) -> tuple[Rows, Rows, dict[str, list[int]], bool]:
    """(rows over all prompts, rows over the chat prompts, plain tokens per prompt, all outputs lossless)."""
    rows: Rows = {(d.label, m): Tally() for d in drafters for m in modes}
    chat_rows: Rows = {key: Tally() for key in rows}
    plain_tokens: dict[str, list[int]] = {}
    all_same = True
    warm = prompts[0].ids
    target.generate(None, False, warm, 4)  # first-call allocations stay out of the ratios
    for d in drafters:
        target.generate(d, False, warm, 4)
    for p in prompts:
        plain = target.generate(None, False, p.ids, n_predict)
        plain_tokens[p.name] = plain.tokens
        print(f"prompt {p.name} ({'chat' if p.chat else 'code'}): {len(p.ids)} tokens, plain {len(plain.tokens)} "
              f"tokens at {len(plain.tokens) / plain.seconds:.2f} tok/s", flush=True)
        for d in drafters:
            pair = [(m, target.generate(d, m == "adaptive", p.ids, n_predict)) for m in modes]
            after = target.generate(None, False, p.ids, n_predict)
            if after.tokens != plain.tokens:
                print(f"  plain decoding is not deterministic on {p.name}", flush=True)
                all_same = False
            for mode, run in pair:
                for table in (rows, chat_rows) if p.chat else (rows,):
                    table[(d.label, mode)].add(run, plain, after)
                same = run.tokens == after.tokens
                rows[(d.label, mode)].same &= same
                all_same &= same
                print(f"  {d.label:<12} {mode:<8}: same={'yes' if same else 'NO'} accepted {run.accepted}/"
                      f"{run.drafted} in {run.rounds} rounds ({run.full_rounds} accepted all {N_MAX}), "
                      f"{len(run.tokens) / run.seconds:.2f} tok/s", flush=True)
            plain = after
    return rows, chat_rows, plain_tokens, all_same


def speedup(r: Tally) -> float:
    return (r.tokens / r.seconds) / (r.plain_tokens / r.plain_seconds) if r.seconds and r.plain_seconds else 0.0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def mean_len(r: Tally) -> float:
    return 1 + r.accepted / r.rounds if r.rounds else 1.0


def print_table(args: argparse.Namespace, rows: Rows, chat_rows: Rows, n_prompts: int) -> None:
    print(f"\nsummed over {n_prompts} prompts (n_predict {args.n_predict}, greedy, n_max {N_MAX}, "
          f"{args.threads} thread(s)):")
    print(f"{'drafter':<16}{'planner':<10}{'same':>5}{'acc rate':>10}{'mean len':>10}{'full':>10}{'tok/s':>9}"
          f"{'plain tok/s':>13}{'x plain':>9}{'chat x':>8}{'cpu x':>7}{'med x':>7}{'med chat':>9}")
    for (label, mode), r in rows.items():
        if not r.tokens:
            continue
        cpu = (r.plain_cpu / r.plain_tokens) / (r.cpu / r.tokens) if r.cpu else 0.0
        print(f"{label:<16}{mode:<10}{'yes' if r.same else 'NO':>5}{r.accepted / max(r.drafted, 1):>10.3f}"
              f"{mean_len(r):>10.2f}{f'{r.full_rounds}/{r.rounds}':>10}{r.tokens / r.seconds:>9.2f}"
              f"{r.plain_tokens / r.plain_seconds:>13.2f}{speedup(r):>8.2f}x{speedup(chat_rows[(label, mode)]):>7.2f}x"
              f"{cpu:>6.2f}x{median(r.ratios):>6.2f}x{median(chat_rows[(label, mode)].ratios):>8.2f}x")


def print_goals(rows: Rows, chat_rows: Rows) -> None:
    parts = []
    for kind, goal in GOAL_LEN.items():
        r = rows.get((kind, "fixed"))
        if r is None or not r.rounds:
            parts.append(f"{kind} mean len >= {goal}: not measured (no head)")
        else:
            parts.append(f"{kind} mean len {mean_len(r):.2f} >= {goal}: {'met' if mean_len(r) >= goal else 'NOT met'}")
    heads = [(speedup(chat_rows[key]), key) for key in chat_rows if key[0] in HEAD_KINDS and chat_rows[key].tokens]
    if heads:
        best, (label, mode) = max(heads)
        parts.append(f"best head on chat ({label} {mode}) {best:.2f}x >= {GOAL_CHAT_SPEEDUP}x: "
                     f"{'met' if best >= GOAL_CHAT_SPEEDUP else 'NOT met'}")
    else:
        parts.append(f"chat speed-up >= {GOAL_CHAT_SPEEDUP}x: not measured (no head or no chat prompt)")
    print("\ngoals: " + "; ".join(parts))


@dataclass(slots=True)
class ServerTally:
    """Sums over one llama-server configuration's completions."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    same: bool = True  # every output equals llama-server's own plain output

    def add(self, c: Completion, plain: Completion) -> None:
        self.tokens += c.predicted_n
        self.seconds += c.predicted_n / c.predicted_per_second if c.predicted_per_second else 0.0
        self.drafted += c.draft_n
        self.accepted += c.draft_n_accepted
        self.rounds += c.verif_steps or 0
        self.same = self.same and c.same_output(plain)


def refusal(log: str) -> str:
    """What a failed llama-server said: its error lines (" E " in its log, or a failed GGML_ASSERT)."""
    lines = log.splitlines()
    errors = [ln.split(" E ", 1)[-1].strip() for ln in lines
              if (" E " in ln or "GGML_ASSERT" in ln) and "warning is normal" not in ln]
    return "; ".join(dict.fromkeys(errors[-3:])) if errors else (lines[-1] if lines else "no log")


def bench_llama_server(args: argparse.Namespace, model: str, n_ctx: int, heads: dict[str, str],
                       prompts: list[Prompt], plain_tokens: dict[str, list[int]], rows: Rows) -> None:
    """llama-server with the same heads and prompt ids, beside spekula's fixed-n_max rows."""
    binary, why = find_llama_server(args.llama_server)
    if binary is None or not heads:
        print(f"\nllama-server: skipped ({why or 'no head to run'})")
        return
    listed = supported_spec_types(binary, [f"draft-{k}" for k in heads])
    # Each completion costs a server three requests (two /metrics reads around it); one is the warm-up.
    prompts = prompts[: MAX_REQUESTS // 3 - 1]
    print(f"\nllama-server {binary}, {len(prompts)} prompts, same GGUF and head files, greedy, n_max {N_MAX}:")
    with contextlib.ExitStack() as stack:
        def start(spec_type: str | None, head: str | None) -> LlamaServer:
            options = {} if head is None else {"model-draft": head, "spec-draft-n-max": N_MAX}
            return stack.enter_context(LlamaServer(binary, model, spec_type=spec_type, options=options,
                                                   n_ctx=n_ctx, n_batch=n_ctx, threads=args.threads))

        plain_server = start(None, None)
        servers: dict[str, LlamaServer] = {}
        for kind, head in heads.items():
            if f"draft-{kind}" not in listed:
                print(f"  {kind}: this llama-server build does not list draft-{kind} in --help")
                continue
            try:
                servers[kind] = start(f"draft-{kind}", head)
                print(f"  {kind}: llama-server loaded {head}")
            except LlamaServerError as exc:
                print(f"  {kind}: llama-server refused {head}: {refusal(str(exc))}")
        def complete(kind: str, p: Prompt, n_predict: int) -> Completion | None:
            """One completion; a server that fails (llama.cpp may crash on a head) leaves the comparison."""
            try:
                return servers[kind].complete(p.ids, n_predict)
            except LlamaServerError as exc:
                print(f"  {kind}: llama-server failed on {p.name}: {refusal(servers[kind].log_tail(400) or str(exc))}")
                del servers[kind]
                return None

        plain_server.complete(prompts[0].ids, 4)  # warm-up
        for kind in list(servers):
            complete(kind, prompts[0], 4)
        totals: dict[str, ServerTally] = {k: ServerTally() for k in ("plain", *servers)}
        plain_like_ours = 0
        for p in prompts:  # interleaved per prompt, so the machine's drift hits every server alike
            base = plain_server.complete(p.ids, args.n_predict)
            plain_like_ours += base.tokens == plain_tokens[p.name]
            totals["plain"].add(base, base)
            for kind in list(servers):
                if (c := complete(kind, p, args.n_predict)) is not None:
                    totals[kind].add(c, base)
    print(f"  llama-server plain output equals spekula's plain output on {plain_like_ours}/{len(prompts)} prompts")
    if not servers:
        return
    plain = totals["plain"]
    plain_tps = plain.tokens / plain.seconds
    print(f"  {'head':<8}{'same':>5}{'acc rate':>10}{'mean len':>10}{'tok/s':>9}{'plain tok/s':>13}{'x plain':>9}"
          f"   | spekula fixed: acc rate, mean len, x plain")
    for kind in servers:
        t, ours = totals[kind], rows[(kind, "fixed")]
        mlen = f"{1 + t.accepted / t.rounds:.2f}" if t.rounds else "n/a"
        print(f"  {kind:<8}{'yes' if t.same else 'NO':>5}{t.accepted / max(t.drafted, 1):>10.3f}{mlen:>10}"
              f"{t.tokens / t.seconds:>9.2f}{plain_tps:>13.2f}{t.tokens / t.seconds / plain_tps:>8.2f}x"
              f"   | {ours.accepted / max(ours.drafted, 1):.3f}, {mean_len(ours):.2f}, {speedup(ours):.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model:
        model = args.model
    else:
        from spekula.backends.gguf.default_model import ensure_default_model

        model = str(ensure_default_model())
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer

    prompts = make_prompts(Tokenizer.from_gguf(GGUFFile(model)), args.n_builtin, args.n_hand, args.training_prompts)
    if not prompts:
        print("nothing to run: --prompts 0 and no hand-written prompt", file=sys.stderr)
        return 2
    if args.chat_only:
        prompts = [p for p in prompts if p.chat]
    heads = find_heads(args, model)
    shipped = shipped_alternatives(args, model, heads) if args.also_shipped else {}
    drafters = drafter_rows(heads, args.torch_runtime, shipped)
    if args.rows:
        drafters = [d for d in drafters if d.label in args.rows.split(",")]
    n_ctx = max(len(p.ids) for p in prompts) + args.n_predict + N_MAX + 16
    target = Target(args, model, n_ctx)
    print(f"model {Path(model).name}, backend {target.backend_name}, {len(prompts)} prompts "
          f"({sum(p.chat for p in prompts)} chat), rows: {', '.join(d.label for d in drafters)}")
    try:
        rows, chat_rows, plain_tokens, same = bench_spekula(target, drafters, prompts, args.n_predict, args.modes)
    finally:
        target.close()
    print_table(args, rows, chat_rows, len(prompts))
    if not args.no_llama_server and "fixed" in args.modes:
        bench_llama_server(args, model, n_ctx, heads, prompts, plain_tokens, rows)
    if args.training_prompts:
        print("\ngoals: not judged (--training-prompts: the heads were trained on these prompts)")
    else:
        print_goals(rows, chat_rows)
    if not same:
        print("LOSSLESS CHECK FAILED: some speculative output differs from plain decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # a SpekulaError (bad -m, bad head ...) is one line, not a traceback
        from spekula.core.errors import SpekulaError

        if not isinstance(exc, SpekulaError):
            raise
        print(f"bench: error: {exc}", file=sys.stderr)
        sys.exit(2)
