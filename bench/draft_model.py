"""draft-simple on SmolLM2: the target as its own draft, and layer-truncated copies of it.

    .venv/bin/python bench/draft_model.py [--quick] [-n 48] [--layers 8,16,24] [--n-max 4,8] [-t 1]
                                          [-m MODEL.gguf] [--draft-dir DIR] [--p-min P]

The drafts are the target itself ("self", a plumbing check: at temperature 0 it must accept every
drafted token) and copies of the target keeping only its first K blocks plus the final norm and
the head, written by the project's own truncation (`spekula truncate-model`, backends/gguf_truncate).
Every prompt is generated greedily without speculation and with each (draft, n_max), on one shared
target backend in one process; a plain run comes before each draft's group and after the last one,
and each speculative run's speed is compared with the mean of the two plain runs that bracket its
group, so slow drift in the machine's load cancels. Every output is checked token for token against
the plain output (greedy speculation must be lossless); any difference makes the exit status 1.

Columns: acc rate = draft_n_accepted / draft_n; mean len = tokens emitted per verification round
(1 + accepted / rounds; the n_predict remainder caps the last round's draft, so even a perfect
draft shows a little under n_max + 1); full = rounds that accepted all n_max tokens / rounds;
tok/s = generation tokens per wall second; ratio = tok/s over the bracketing plain runs; cpu =
plain process-CPU seconds per token over this run's, whole request (prompt included, so the
draft's own prompt prefill counts; with one torch thread CPU time is robust to a loaded machine,
where wall time mostly measures the neighbours).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS: dict[str, str] = {
    "chat": "What are the main causes of the seasons on Earth? Explain it to a curious ten-year-old.",
    "code": "Write a Python function that checks whether a string is a palindrome, ignoring case and "
    "punctuation, with a docstring and two examples.",
    "facts": "List five interesting facts about octopuses, one sentence each.",
}


@dataclass(slots=True)
class Tally:
    """Sums over the runs of one (draft, n_max) row."""

    tokens: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    full_rounds: int = 0
    plain_tokens: int = 0  # the bracketing plain runs, for the ratio
    plain_seconds: float = 0.0
    plain_cpu: float = 0.0
    same: bool = True
    per_prompt: list[str] = field(default_factory=list)
    # Each run's tok/s over its bracketing plain runs': their median shrugs off a load spike in one run
    # on a shared machine, which the summed ratio does not.
    ratios: list[float] = field(default_factory=list)

    def add(self, run: Run, plain_a: Run, plain_b: Run) -> None:
        plain_seconds = plain_a.seconds + plain_b.seconds
        if run.seconds > 0 and plain_seconds > 0:
            self.ratios.append((len(run.tokens) / run.seconds) / ((len(plain_a.tokens) + len(plain_b.tokens)) / plain_seconds))
        self.tokens += len(run.tokens)
        self.seconds += run.seconds
        self.cpu += run.cpu
        self.drafted += run.drafted
        self.accepted += run.accepted
        self.rounds += run.rounds
        self.full_rounds += run.full_rounds
        for p in (plain_a, plain_b):
            # Half weight each: the pair stands for one plain run at the time of this group.
            self.plain_tokens += len(p.tokens)
            self.plain_seconds += p.seconds
            self.plain_cpu += p.cpu


@dataclass(frozen=True, slots=True)
class Run:
    tokens: list[int]
    seconds: float  # generation wall time (the engine's predicted_ms)
    cpu: float  # process CPU seconds of the whole request, prompt included
    drafted: int
    accepted: int
    rounds: int
    full_rounds: int  # rounds that accepted n_max draft tokens (a whole full-length draft)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--n-predict", type=int, help="tokens per generation (default 48)")
    p.add_argument("--layers", help="K of each truncated draft, comma list (default 8,16,24)")
    p.add_argument("--no-self", action="store_true", help="skip the target-as-its-own-draft run")
    p.add_argument("--n-max", help="--spec-draft-n-max values, comma list (default 4,8)")
    p.add_argument("--p-min", type=float, default=0.0, help="--spec-draft-p-min (default 0.0, llama.cpp's)")
    p.add_argument("--prompts", help=f"comma list from {', '.join(PROMPTS)} (default chat,code)")
    p.add_argument("-t", "--threads", type=int, default=1, help="torch threads (default 1: steadier when shared)")
    p.add_argument("--draft-dir", help="write (and keep) the truncated drafts here instead of a temp dir")
    p.add_argument("--quick", action="store_true",
                   help="smoke run; defaults become -n 32, --layers 8,24, --n-max 4, --prompts chat")
    args = p.parse_args(argv)
    # Options given explicitly win over --quick's smaller defaults.
    quick = {"n_predict": 32, "layers": "8,24", "n_max": "4", "prompts": "chat"}
    # 48 tokens keeps the full run (bad drafts at n_max 8 run near 2 tok/s) well under 10 minutes on
    # a shared 2-core machine; at -n 64 it took about 9.
    full = {"n_predict": 48, "layers": "8,16,24", "n_max": "4,8", "prompts": "chat,code"}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.n_predict < 1:
        p.error("-n must be >= 1")
    try:
        args.layer_list = [int(v) for v in args.layers.split(",") if v]
        args.n_max_list = [int(v) for v in args.n_max.split(",") if v]
    except ValueError as exc:
        p.error(f"--layers and --n-max take comma-separated integers ({exc})")
    if any(n < 1 for n in args.n_max_list):
        p.error("--n-max values must be >= 1")
    args.prompt_list = [s for s in args.prompts.split(",") if s]
    unknown = [s for s in args.prompt_list if s not in PROMPTS]
    if unknown:
        p.error(f"unknown prompt(s) {unknown}; choose from {', '.join(PROMPTS)}")
    return args


def make_drafts(model: str, layers: list[int], out_dir: Path) -> list[tuple[str, str]]:
    """(label, path) for each draft: the target itself, then one truncated copy per K."""
    from spekula.backends.convert.truncate import truncate_gguf

    drafts = []
    for k in layers:
        t0 = time.perf_counter()
        r = truncate_gguf(model, out_dir / f"{Path(model).stem}.first{k}.gguf", k)
        print(f"truncated: {r.path.name}: {r.n_layer_out} of {r.n_layer_in} layers, "
              f"{r.n_bytes / 2**20:.1f} MiB ({time.perf_counter() - t0:.1f} s)")
        drafts.append((f"K={k}/{r.n_layer_in}", str(r.path)))
    return drafts


def bench(args: argparse.Namespace, model: str, drafts: list[tuple[str, str]]) -> bool:
    """Run every prompt and draft; print the table; True when every output matched plain decoding."""
    import anyio

    from spekula.core.backend import BackendOptions, load_backend
    from spekula.core.engine.engine import Engine, EngineConfig
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer
    from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

    tok = Tokenizer.from_gguf(GGUFFile(model))
    prompts = {name: tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[name]}]))
               for name in args.prompt_list}
    n_ctx = max(len(p) for p in prompts.values()) + args.n_predict + max(args.n_max_list) + 16
    opts = BackendOptions(n_ctx=n_ctx, n_seq_max=len(drafts) + 1, threads=args.threads)
    target = load_backend("torch", model, opts)
    # One engine per draft (the draft model is an engine-wide setting), all on the one target
    # backend, plus one without drafters; the draft backends follow the target's options.
    spec = SpecParams(types=("draft-simple",), n_max=max(args.n_max_list), p_min=args.p_min)
    plain_engine = Engine(target, tok, EngineConfig(n_slots=1, n_ctx=n_ctx))
    engines = {label: Engine(target, tok, EngineConfig(n_slots=1, n_ctx=n_ctx, spec=spec),
                             draft_model_path=path, draft_backend_options=opts)
               for label, path in drafts}
    greedy = SamplingParams(temperature=0.0)

    async def generate(engine: Engine, prompt: list[int], n_predict: int, n_max: int | None) -> Run:
        req_spec = SpecParams() if n_max is None else spec.with_(n_max=n_max)
        cpu0 = time.process_time()
        final = await engine.submit(CompletionRequest(prompt, n_predict=n_predict, sampling=greedy,
                                                      spec=req_spec)).result()
        cpu = time.process_time() - cpu0
        if final.error:
            raise SystemExit(f"bench: {final.error}")
        st = engine.request_stats[final.request_id]["spec"]
        full = st.histogram[n_max] if n_max is not None and len(st.histogram) > n_max else 0
        return Run(final.tokens, final.timings["predicted_ms"] / 1e3, cpu,
                   st.n_draft_tokens, st.n_draft_accepted, st.n_verif_steps, full)

    rows: dict[tuple[str, int], Tally] = {(label, n): Tally() for label, _ in drafts for n in args.n_max_list}
    all_same = True

    async def main() -> None:
        nonlocal all_same
        async with anyio.create_task_group() as tg:
            for e in (plain_engine, *engines.values()):
                await tg.start(e.run)
            warm = next(iter(prompts.values()))
            await generate(plain_engine, warm, 4, None)  # first-call allocations stay out of the ratios
            for e in engines.values():
                await generate(e, warm, 4, args.n_max_list[0])
            for pname, prompt in prompts.items():
                plain = await generate(plain_engine, prompt, args.n_predict, None)
                print(f"prompt {pname}: {len(prompt)} tokens, plain {len(plain.tokens)} tokens at "
                      f"{len(plain.tokens) / plain.seconds:.2f} tok/s", flush=True)
                for label, _ in drafts:
                    group = [(n, await generate(engines[label], prompt, args.n_predict, n))
                             for n in args.n_max_list]
                    after = await generate(plain_engine, prompt, args.n_predict, None)
                    if after.tokens != plain.tokens:
                        print(f"  plain decoding is not deterministic on {pname}", flush=True)
                        all_same = False
                    for n, run in group:
                        row = rows[(label, n)]
                        row.add(run, plain, after)
                        same = run.tokens == after.tokens
                        row.same &= same
                        all_same &= same
                        print(f"  {label:<9} n_max {n}: same={'yes' if same else 'NO'} "
                              f"accepted {run.accepted}/{run.drafted} in {run.rounds} rounds "
                              f"({run.full_rounds} accepted all {n}), "
                              f"{len(run.tokens) / run.seconds:.2f} tok/s", flush=True)
                    plain = after
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        for e in (plain_engine, *engines.values()):
            e.close()
        target.close()
    print_table(args, rows)
    return all_same


def print_table(args: argparse.Namespace, rows: dict[tuple[str, int], Tally]) -> None:
    print(f"\nsummed over prompts {','.join(args.prompt_list)} (n_predict {args.n_predict}, greedy, "
          f"p_min {args.p_min}, {args.threads} torch thread(s)):")
    print(f"{'draft':<10}{'n_max':>6}{'same':>6}{'acc rate':>10}{'mean len':>10}{'full':>8}{'tok/s':>9}"
          f"{'plain tok/s':>13}{'ratio':>8}{'cpu':>7}")
    for (label, n), r in rows.items():
        if not r.rounds:
            continue
        tps = r.tokens / r.seconds
        plain_tps = r.plain_tokens / r.plain_seconds
        # CPU per token, plain over speculative: >1 means speculation spent less CPU per token.
        cpu_ratio = (r.plain_cpu / r.plain_tokens) / (r.cpu / r.tokens)
        print(f"{label:<10}{n:>6}{'yes' if r.same else 'NO':>6}{r.accepted / max(r.drafted, 1):>10.3f}"
              f"{1 + r.accepted / r.rounds:>10.2f}{f'{r.full_rounds}/{r.rounds}':>8}{tps:>9.2f}{plain_tps:>13.2f}{tps / plain_tps:>7.2f}x"
              f"{cpu_ratio:>6.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model:
        model = args.model
    else:
        from spekula.backends.gguf.default_model import ensure_default_model

        model = str(ensure_default_model())
    with tempfile.TemporaryDirectory(prefix="spekula-drafts-") as tmp:
        out_dir = Path(args.draft_dir) if args.draft_dir else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        drafts = [] if args.no_self else [("self", model)]
        drafts += make_drafts(model, args.layer_list, out_dir)
        if not drafts:
            print("nothing to run: --no-self and no --layers", file=sys.stderr)
            return 2
        same = bench(args, model, drafts)
    if not same:
        print("LOSSLESS CHECK FAILED: some speculative output differs from plain decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # a SpekulaError (bad -m, bad K ...) is one line, not a traceback
        from spekula.core.errors import SpekulaError

        if not isinstance(exc, SpekulaError):
            raise
        print(f"bench: error: {exc}", file=sys.stderr)
        sys.exit(2)
