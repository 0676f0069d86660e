"""Constrained decoding (JSON schemas through llguidance) with and without speculation, on SmolLM2.

    .venv/bin/python bench/structured.py --reps 3 [-m MODEL.gguf] [--threads 2] [--backend native]
                                         [--ngram default|small] [--spec-adaptive on|off]

One stream, greedy, the native backend. Two workloads: "json-repeat" (8 customer records given as
JSON in the prompt, to be returned as a JSON array without their "age" field: most of the answer
repeats the prompt; unconstrained, the model copies them too, dropping a field of its choice) and "json-fresh" (a recipe as a small JSON object: nothing to copy). Each runs
in four variants: plain, plain+grammar, spec, spec+grammar, where spec is the n-gram pair
`ngram-simple,ngram-mod` (llama.cpp's default sizes: ngram-simple N=12 M=48, ngram-mod n-match 24,
n-min 48, n-max 64; `--ngram small` uses N=4 M=16 and n-match 8, n-min 4, n-max 16) and grammar is
the workload's JSON schema. Every run is on a fresh engine (no drafter state carried over) that
shares one grammar compiler, warmed up by one excluded request (building llguidance's view of the
vocabulary takes ~0.2 s). The variants run --reps times in an order that rotates between
repetitions; a ratio is the median over repetitions of tok/s over the plain tok/s of the same
repetition (the machine's speed drifts).

Reported per variant: decode tok/s (timings["predicted_per_second"]), x plain; for the grammar
variants the mask cost per token (seconds / rows of every masking call, median and p99 over all
calls of all repetitions) and the mask time as a share of the decode time (timings["predicted_ms"],
which starts after the prompt's forward, so the prompt is excluded); "speed-up kept" =
(spec+grammar / plain+grammar) / (spec / plain), per repetition, median. Checks: spec+grammar emits
exactly the plain+grammar tokens, spec exactly the plain ones, and the constrained answers parse as
JSON and validate against the schema.

Goals: constraints cost < 10% of decode time; speculation keeps >= 80% of its unconstrained
speed-up on json-repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

N_CTX = 4096
PAIR = ("ngram-simple", "ngram-mod")
VARIANTS = ("plain", "plain+grammar", "spec", "spec+grammar")
NGRAM_OPTIONS: dict[str, dict[str, int]] = {
    "default": {},  # the drafters' own defaults, which are llama.cpp's
    "small": {"spec-ngram-simple-size-n": 4, "spec-ngram-simple-size-m": 16, "spec-ngram-mod-n-match": 8,
              "spec-ngram-mod-n-min": 4, "spec-ngram-mod-n-max": 16},
}
MASK_GOAL = 0.10
KEPT_GOAL = 0.80

_PEOPLE = [
    ("Alice Martin", "Paris", 34), ("Bruno Costa", "Lisbon", 41), ("Chen Wei", "Shanghai", 29),
    ("Dana Cohen", "Haifa", 52), ("Erik Larsen", "Oslo", 38), ("Fatima Zahra", "Rabat", 26),
    ("Giorgio Rossi", "Milan", 47), ("Hana Sato", "Kyoto", 31),
]
CITIES = sorted({city for _, city, _ in _PEOPLE})
RECORDS = [{"name": name, "city": city, "age": age, "email": name.split()[0].lower() + "@example.com"}
           for name, city, age in _PEOPLE]

REPEAT_PROMPT = "Customer records:\n" + json.dumps(RECORDS) + '\n\nReturn these records as a JSON array without the "age" field.'
REPEAT_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": len(RECORDS),
    "maxItems": len(RECORDS),
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "city": {"type": "string", "enum": CITIES},
            "email": {"type": "string"},
        },
        "required": ["name", "city", "email"],
        "additionalProperties": False,
    },
}

FRESH_PROMPT = "Give me a simple recipe for pancakes as JSON, with a title, a list of ingredients and a list of steps."
FRESH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 2, "maxItems": 6},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 2, "maxItems": 4},
    },
    "required": ["title", "ingredients", "steps"],
    "additionalProperties": False,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every variant (rotating order)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="native")
    p.add_argument("--n-repeat", type=int, default=300, help="n_predict of json-repeat")
    p.add_argument("--n-fresh", type=int, default=150, help="n_predict of json-fresh")
    p.add_argument("--ngram", choices=sorted(NGRAM_OPTIONS), default="default", help="n-gram drafter sizes")
    p.add_argument("--spec-adaptive", choices=("on", "off"), default="on",
                   help="adaptive draft lengths (spekula's default) or llama.cpp's fixed ones")
    return p.parse_args(argv)


class Bench:
    """One backend and one grammar compiler; a fresh engine per run."""

    def __init__(self, args: argparse.Namespace) -> None:
        from spekula.core.backend import BackendOptions, load_backend
        from spekula.core.modelfile.gguf_file import GGUFFile
        from spekula.core.modelfile.grammar_llg import Grammars
        from spekula.core.modelfile.tokenizer import Tokenizer

        self.args = args
        self.model = args.model or self._default_model()
        self.backend = load_backend(args.backend, self.model,
                                    BackendOptions(n_ctx=N_CTX, n_seq_max=1, threads=args.threads))
        self.tokenizer = Tokenizer.from_gguf(GGUFFile(self.model))
        self.grammars = Grammars(self.tokenizer)
        self.constraints: list[Any] = []  # every constraint created, in order
        new = self.grammars.new

        def recording_new(spec: Any) -> Any:
            c = new(spec)
            self.constraints.append(c)
            return c

        self.grammars.new = recording_new  # type: ignore[method-assign]

    @staticmethod
    def _default_model() -> str:
        from spekula.backends.gguf.default_model import ensure_default_model

        return str(ensure_default_model())

    def chat_prompt(self, text: str) -> list[int]:
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return [int(t) for t in self.tokenizer.encode(rendered, add_special=True)]

    def run(self, prompt: list[int], n_predict: int, spec_on: bool, schema: dict[str, Any] | None
            ) -> tuple[Any, Any]:
        """One request on a fresh engine: (final event, its constraint or None)."""
        import anyio

        from spekula.core.engine.engine import Engine, EngineConfig
        from spekula.core.modelfile.constraint import GrammarSpec
        from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

        spec = SpecParams(types=PAIR if spec_on else (), adaptive=self.args.spec_adaptive == "on",
                          drafter_options=dict(NGRAM_OPTIONS[self.args.ngram]))
        engine = Engine(self.backend, self.tokenizer, EngineConfig(n_slots=1, n_ctx=N_CTX, spec=spec),
                        backend_name=self.args.backend)
        engine.grammars = self.grammars  # shared: compiled once, vocabulary view built once
        grammar = None if schema is None else GrammarSpec("json_schema", json.dumps(schema))
        req = CompletionRequest(prompt, n_predict=n_predict, sampling=SamplingParams(temperature=0.0), grammar=grammar)
        before = len(self.constraints)
        out: list[Any] = []

        async def go() -> None:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.run)
                out.append(await engine.submit(req).result())
                tg.cancel_scope.cancel()

        try:
            anyio.run(go)
        finally:
            engine.close()
        final = out[0]
        if final.error:
            raise SystemExit(f"bench: {final.error}")
        created = self.constraints[before:]
        if grammar is not None and len(created) != 1:
            raise SystemExit(f"bench: expected one constraint for the request, got {len(created)}")
        return final, (created[0] if created else None)


def validate(text: str, schema: dict[str, Any]) -> str:
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"NO (not JSON: {exc})"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return f"NO (schema: {exc.message})"
    return "yes"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(bench: Bench, name: str, text: str, schema: dict[str, Any], n_predict: int) -> dict[str, Any]:
    prompt = bench.chat_prompt(text)
    configs = {"plain": (False, None), "plain+grammar": (False, schema), "spec": (True, None),
               "spec+grammar": (True, schema)}
    tps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    mask_share: dict[str, list[float]] = {v: [] for v in VARIANTS}
    per_row: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rows_per_call: dict[str, list[int]] = {v: [] for v in VARIANTS}
    finals: dict[str, Any] = {}
    for rep in range(bench.args.reps):
        order = list(VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)])
        for v in order:
            spec_on, sch = configs[v]
            final, constraint = bench.run(prompt, n_predict, spec_on, sch)
            tps[v].append(final.timings["predicted_per_second"])
            if constraint is not None:
                calls = list(constraint.mask_calls)
                per_row[v] += [sec / rows for rows, sec in calls]
                rows_per_call[v] += [rows for rows, _ in calls]
                mask_share[v].append(sum(sec for _, sec in calls) / (final.timings["predicted_ms"] / 1e3))
            if v in finals and list(final.tokens) != list(finals[v].tokens):
                raise SystemExit(f"bench: {name}/{v} is not deterministic across repetitions")
            finals[v] = final
    ratio = {v: statistics.median(a / b for a, b in zip(tps[v], tps["plain"], strict=True)) for v in VARIANTS}
    kept = statistics.median((sg / pg) / (s / p) for p, pg, s, sg in
                             zip(tps["plain"], tps["plain+grammar"], tps["spec"], tps["spec+grammar"], strict=True))
    f = finals["spec+grammar"]
    return {
        "name": name, "prompt_n": len(prompt), "n_predict": n_predict, "tps": tps, "ratio": ratio, "kept": kept,
        "per_row": per_row, "rows_per_call": rows_per_call, "mask_share": mask_share, "finals": finals,
        "same_grammar": list(f.tokens) == list(finals["plain+grammar"].tokens),
        "same_plain": list(finals["spec"].tokens) == list(finals["plain"].tokens),
        "valid": {v: validate(finals[v].content, schema) for v in ("plain+grammar", "spec+grammar")},
        "plain_valid": validate(finals["plain"].content, schema),
    }


def print_results(bench: Bench, results: list[dict[str, Any]]) -> list[str]:
    args = bench.args
    print(f"\n## Constrained decoding, one stream, greedy, median of {args.reps} (x plain of the same repetition)\n")
    print("| workload | variant | tok/s | x plain | tokens | acc/drafted | mask µs/token median | p99 | rows/call "
          "| mask % of decode |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for v in VARIANTS:
            f = r["finals"][v]
            t = f.timings
            acc = f"{t.get('draft_n_accepted', 0)}/{t.get('draft_n', 0)}" if t.get("draft_n") else "-"
            if r["per_row"][v]:
                pr = r["per_row"][v]
                mask = (f"{statistics.median(pr) * 1e6:.0f} | {pct(pr, 0.99) * 1e6:.0f} | "
                        f"{statistics.mean(r['rows_per_call'][v]):.1f} | {statistics.median(r['mask_share'][v]):.1%}")
            else:
                mask = "- | - | - | -"
            print(f"| {r['name']} | {v} | {statistics.median(r['tps'][v]):.1f} | {r['ratio'][v]:.2f}x | "
                  f"{len(f.tokens)} ({f.stop_type}) | {acc} | {mask} |")
    print("\n| workload | prompt tokens | n_predict | spec x plain | spec+grammar x plain+grammar | speed-up kept "
          "| spec+grammar == plain+grammar | spec == plain | plain+grammar valid | spec+grammar valid "
          "| plain (no grammar) valid |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        sg = r["ratio"]["spec+grammar"] / r["ratio"]["plain+grammar"]
        print(f"| {r['name']} | {r['prompt_n']} | {r['n_predict']} | {r['ratio']['spec']:.2f}x | {sg:.2f}x | "
              f"**{r['kept']:.0%}** | {'yes' if r['same_grammar'] else 'NO'} | {'yes' if r['same_plain'] else 'NO'} | "
              f"{r['valid']['plain+grammar']} | {r['valid']['spec+grammar']} | {r['plain_valid']} |")
    for r in results:
        print(f"\n{r['name']} spec+grammar answer:\n{r['finals']['spec+grammar'].content}")

    failures: list[str] = []
    for r in results:
        if not r["same_grammar"]:
            failures.append(f"{r['name']}: spec+grammar output differs from plain+grammar")
        if not r["same_plain"]:
            failures.append(f"{r['name']}: spec output differs from plain")
        for v, ok in r["valid"].items():
            if ok != "yes":
                failures.append(f"{r['name']}/{v}: {ok}")
    worst = max((statistics.median(r["mask_share"][v]), f"{r['name']}/{v}") for r in results
                for v in ("plain+grammar", "spec+grammar"))
    repeat = next(r for r in results if r["name"] == "json-repeat")
    print("\n## Goals\n")
    print(f"- constraints cost < {MASK_GOAL:.0%} of decode time: worst {worst[0]:.1%} ({worst[1]}): "
          f"**{'MET' if worst[0] < MASK_GOAL else 'NOT MET'}**")
    print(f"- speculation keeps >= {KEPT_GOAL:.0%} of its unconstrained speed-up on json-repeat: {repeat['kept']:.0%} "
          f"(spec {repeat['ratio']['spec']:.2f}x plain, spec+grammar "
          f"{repeat['ratio']['spec+grammar'] / repeat['ratio']['plain+grammar']:.2f}x plain+grammar): "
          f"**{'MET' if repeat['kept'] >= KEPT_GOAL else 'NOT MET'}**")
    for r in results:
        free, bound = r["finals"]["spec"], r["finals"]["spec+grammar"]
        if list(free.tokens) != list(bound.tokens):
            print(f"  note ({r['name']}): the unconstrained answer is not the constrained one ({len(free.tokens)} vs "
                  f"{len(bound.tokens)} tokens, drafts accepted {free.timings.get('draft_n_accepted', 0)}/"
                  f"{free.timings.get('draft_n', 0)} vs {bound.timings.get('draft_n_accepted', 0)}/"
                  f"{bound.timings.get('draft_n', 0)}): \"kept\" compares speed-ups on different texts")
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    opts = NGRAM_OPTIONS[args.ngram]
    print(f"model {Path(bench.model).name}, backend {args.backend}, {args.threads} threads, greedy; spec = "
          f"{','.join(PAIR)}, adaptive {args.spec_adaptive}, n-gram sizes {args.ngram}"
          + (f" ({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else " (llama.cpp's)"))
    # Warm-up, excluded: llguidance's vocabulary view, the schemas' compiles, the backend's first forwards.
    warm = bench.chat_prompt("Say hello as JSON.")
    for schema in (REPEAT_SCHEMA, FRESH_SCHEMA):
        bench.run(warm, 8, True, schema)
    workloads = [("json-repeat", REPEAT_PROMPT, REPEAT_SCHEMA, args.n_repeat),
                 ("json-fresh", FRESH_PROMPT, FRESH_SCHEMA, args.n_fresh)]
    results = [measure(bench, *w) for w in workloads]
    failures = print_results(bench, results)
    bench.backend.close()
    if failures:
        print("\nFAIL: " + "; ".join(failures))
        return 1
    print("\nOK: speculation changes no output; every constrained answer is valid JSON under its schema")
    return 0


if __name__ == "__main__":
    sys.exit(main())
