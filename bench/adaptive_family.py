"""Adaptive draft lengths against one fixed cap per workload family, on SmolLM2.

    .venv/bin/python bench/adaptive_family.py [--replay [--records F]] [-n 128] [--reps 3] [--threads 2]

bench/adaptive.py compares the adaptive planner with the best of a sweep of fixed caps on one
code-rewrite prompt and one repeat-then-summarise prompt. A user sets one `--spec-draft-n-max` for a
kind of work, not one per prompt, and the best of five noisy cells on a single prompt is biased
upwards by the noise itself. Here each family holds several prompts of one kind:

    code-rewrite      rename a variable in a function and return the whole code: the order summary of
                      bench/ngram.py and functions of this Python's own standard library
    repeat-summarise  repeat a paragraph word for word, then summarise it (six paragraphs)

For each family and drafter set (`ngram-mod,ngram-simple` and `suffix`), plain decoding, fixed
lengths with every drafter's cap at 4, 8, 16, 32 and 64 (`--spec-adaptive off`), and adaptive
lengths with the default caps. A configuration's family speed is its tokens over its decode time
summed over the family's prompts, taken against plain decoding's in the same repetition; the median
over --reps rotating repetitions is reported. The goal (issue: speculation that always pays):
adaptive >= 0.95x the best single fixed cap of the family. The per-prompt view of bench/adaptive.py
(adaptive over the best cap of each prompt on its own) is printed beside it, and a held-out view: the
cap is chosen on the even repetitions and adaptive is scored against it on the odd ones, so the noise
that makes a cap look best is not also the noise it is scored on.

With --replay the engine runs against bench/adaptive_replay.py's replaying backend (each prompt's
recorded greedy answer and the recorded time of a forward of 1..65 rows), which takes this machine's
drift out of the comparison; without it, the real native backend. Every answer is checked against
plain decoding.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import statistics
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ is not a package
from adaptive import CAPS, PAIR, Bench, caps_options, held_out  # noqa: E402
from adaptive_replay import ReplayBench  # noqa: E402
from ngram import _CODE, _PARAGRAPH  # noqa: E402

# Standard-library functions of 20-70 lines (each answer's first n_predict tokens are what is timed).
STDLIB_FUNCTIONS = ("difflib:get_close_matches", "textwrap:dedent", "json.encoder:py_encode_basestring_ascii",
                    "ipaddress:collapse_addresses", "glob:_iglob", "base64:b64decode", "statistics:median_grouped")
PARAGRAPHS = (
    _PARAGRAPH,
    "Every spring the river below the mill floods the lower meadow for about three weeks. The farmers "
    "who rent the land plant late because of it, usually barley, and they leave a strip of willows along "
    "the bank to hold the soil. In dry years the flood never comes, and the meadow has to be watered by "
    "hand from a pump that was installed in 1952 and still works.",
    "The town library moved into the old railway station in 1987, after the last passenger train had "
    "stopped running. The ticket hall became the reading room, the waiting room holds the children's "
    "books, and the platform, now glassed in, is where people sit with newspapers in the morning. The "
    "station clock above the entrance was repaired and still keeps time.",
    "A small bakery on the corner opens at five in the morning and usually sells out of rye bread by "
    "nine. The owner learned to bake from her grandmother and still uses the same sourdough starter, "
    "which she says is older than the building. On Saturdays there is a queue outside before the door "
    "opens, and regular customers bring their own cloth bags.",
    "The observatory on the hill has a telescope that was bought second-hand from a university in 1960. "
    "Volunteers open it to the public on clear Friday nights from October to March. Most visitors come "
    "to see the rings of Saturn or the craters of the moon, and a few return every week to keep a record "
    "of the variable stars that the club has watched for forty years.",
    "When the canal was closed to freight in 1968, its locks were left to rot and the towpath was "
    "overgrown within a decade. A group of residents began clearing it on weekends in the 1990s. Today "
    "the path is a cycle route between two towns, three of the locks work again, and narrow boats for "
    "hire pass through them all summer.",
)


def stdlib_rewrite_prompts() -> list[str]:
    """Rename each function's most used local variable, the way the order-summary prompt does."""
    import importlib

    prompts = ["Rename the variable `total` to `grand_total` and return the whole code.\n\n" + _CODE]
    for spec in STDLIB_FUNCTIONS:
        module_name, qualname = spec.split(":")
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        source = textwrap.dedent(inspect.getsource(obj))  # a method is indented in its class
        tree = ast.parse(source).body[0]
        assert isinstance(tree, ast.FunctionDef)
        args = {a.arg for a in tree.args.args + tree.args.kwonlyargs}
        stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        uses = Counter(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in stored - args)
        if not uses:
            continue
        name = max(sorted(uses), key=lambda n: uses[n])
        prompts.append(f"Rename the variable `{name}` to `{name}_value` and return the whole code.\n\n{source}\n")
    return prompts


FAMILIES = {
    "code-rewrite": stdlib_rewrite_prompts,
    "repeat-summarise": lambda: ["Repeat the following paragraph word for word, then summarise it in one "
                                 "sentence.\n\n" + p for p in PARAGRAPHS],
}
Config = tuple[tuple[str, ...], bool, dict[str, Any]]


def configs() -> dict[str, Config]:
    out: dict[str, Config] = {"plain": ((), False, {})}
    for label, types in (("pair", PAIR), ("suffix", ("suffix",))):
        for cap in CAPS:
            out[f"{label} fixed {cap}"] = (types, False, caps_options(cap))
        out[f"{label} adaptive"] = (types, True, {})
    return out


def run_family(bench: Bench, family: str, texts: list[str]) -> dict[str, Any]:
    """Per repetition and configuration: tokens and decode seconds per prompt."""
    replay = bench if isinstance(bench, ReplayBench) else None
    names = [f"{family}{i}" for i in range(len(texts))]  # the records' names (--records keeps several families)
    prompts = [replay.prepare(n, text) if replay else bench.chat_prompt(text) for n, text in zip(names, texts, strict=True)]
    all_configs = configs()
    config_names = list(all_configs)
    # seconds[name][rep][prompt], tokens[prompt]
    seconds: dict[str, list[list[float]]] = {n: [] for n in config_names}
    tokens: list[int] = []
    wants: list[list[int]] = []
    for rep in range(bench.args.reps):
        order = config_names[rep % len(config_names):] + config_names[: rep % len(config_names)]
        for n in config_names:
            seconds[n].append([0.0] * len(prompts))
        for i, prompt in enumerate(prompts):
            if replay is not None:
                record, curve = replay.records[names[i]]
                replay.backend.load(record, curve)
            for name in order:  # the first repetition starts with plain: its answers are the reference
                final = bench.one(prompt, *all_configs[name])
                got = [int(t) for t in final.tokens]
                if len(wants) == i:
                    tokens.append(len(got))
                    wants.append(got)
                else:
                    bench.check(f"prompt {i}/{name}", got, wants[i])
                seconds[name][rep][i] = final.timings["predicted_ms"] / 1e3
    return {"names": config_names, "seconds": seconds, "tokens": tokens}


def family_ratio(result: dict[str, Any], name: str, subset: list[int] | None = None,
                 reps: range | None = None) -> float:
    """Median over repetitions (those in `reps`, default all) of the speed of `name` over plain's on the
    prompts in `subset`: both emit the same tokens, so it is plain's decode time over this configuration's."""
    idx = subset if subset is not None else range(len(result["tokens"]))
    pairs = list(zip(result["seconds"][name], result["seconds"]["plain"], strict=True))
    chosen = [pairs[r] for r in reps] if reps is not None else pairs
    return statistics.median(sum(plain[i] for i in idx) / sum(mine[i] for i in idx) for mine, plain in chosen)


def report(family: str, result: dict[str, Any]) -> list[str]:
    names = result["names"]
    n_prompts = len(result["tokens"])
    print(f"\n### {family}: {n_prompts} prompts, {sum(result['tokens'])} tokens (x plain of the family)\n")
    print("| config | family x plain | per prompt x plain |")
    print("|---|---:|---|")
    whole = {name: family_ratio(result, name) for name in names[1:]}
    per = {name: [family_ratio(result, name, [i]) for i in range(n_prompts)] for name in names[1:]}
    for name in names[1:]:
        print(f"| {name} | {whole[name]:.3f}x | {' '.join(f'{r:.2f}' for r in per[name])} |")
    lines = []

    def ratio_on(name: str, reps: range) -> float:
        return family_ratio(result, name, reps=reps)

    for label in ("pair", "suffix"):
        caps = [f"{label} fixed {c}" for c in CAPS]
        best = max(caps, key=whole.__getitem__)
        adaptive = f"{label} adaptive"
        per_prompt = [per[adaptive][i] / max(per[c][i] for c in caps) for i in range(n_prompts)]
        lines.append(f"| {family} | {label} | {best.rsplit(' ', 1)[1]} | {whole[best]:.3f}x | "
                     f"{whole[adaptive]:.3f}x | **{whole[adaptive] / whole[best]:.3f}x** | "
                     f"{statistics.median(per_prompt):.3f}x ({min(per_prompt):.2f}-{max(per_prompt):.2f}) | "
                     f"{held_out(label, len(result['seconds']['plain']), ratio_on, digits=3)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="rotating repetitions (median of family ratios)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--replay", action="store_true", help="replay recorded answers and forward times")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--records", help="with --replay: JSON file of recorded answers and forward times, used where it "
                   "holds a prompt's and written with those it lacks (to replay the same records on two checkouts)")
    args = p.parse_args(argv)
    args.backend = "native"
    if args.replay:
        bench: Bench = ReplayBench(args)
    else:
        bench = Bench(args)
        bench.one(bench.chat_prompt("Hello")[:32], (), False, {})  # warm-up
    mode = "replayed forwards timed on the native backend" if args.replay else "the native backend"
    print(f"model {Path(bench.model).name}, {mode}, {args.threads} threads, n_predict {args.n_predict}, "
          f"{args.reps} repetitions, Python {sys.version.split()[0]}")
    summary: list[str] = []
    for family in args.families.split(","):
        summary += report(family, run_family(bench, family, FAMILIES[family]()))
    print("\n| family | drafters | best family cap | best cap x plain | adaptive x plain | adaptive / best cap "
          "| per prompt: adaptive / that prompt's best cap, median (range) "
          "| held out: cap chosen on even repetitions, adaptive / it on odd ones |")
    print("|---|---|---|---:|---:|---:|---|---|")
    print("\n".join(summary))
    if isinstance(bench, ReplayBench):
        bench.real.close()
    print("\nFAIL: outputs differ: " + ", ".join(bench.failures) if bench.failures
          else "\nOK: every output equals plain decoding")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
