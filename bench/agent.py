"""An agent's own workload: a coding-agent session replayed against `spekula serve` and llama-server.

    .venv/bin/python bench/agent.py [-m MODEL] [--threads 2] [--reps 2] [--llama-server PATH]
        [--chat-template-file FILE] [--engines spekula,llama] [--configs NAME,...] [--max-tokens-factor 1.5]
        [--turns N]

The session (bench/data/agent_session.json, on the small repository bench/data/agent_repo) is what a
coding agent sends: a search and a read through tools, then five edits, each one a `write_file` call
carrying the whole new file, every tool result and earlier call kept in the history. Each assistant
tool-call turn is replayed as one chat request holding the whole conversation before it, with the
session's three tools and `tool_choice` naming the function the recorded turn called (so the call is
forced by a grammar on both servers), greedy, `cache_prompt` on, the turns in order on one server
process, as an agent resends its conversation.

Configurations, each in a fresh server process per repetition (alternating, so drifting load hits all
alike): llama-server and spekula plain, each one's `--spec-default`, spekula's `suffix` (adaptive
lengths, the default), and llama-server's n-gram types. Printed: per configuration decode tokens/s per
turn and overall (the server's own `timings`), the whole session's wall time, prompt tokens reused
from the cache per turn; then the ratios the goals name: spekula `--spec-default` over llama-server
`--spec-default`, and each engine's best speculative configuration over the other's. Every spekula
configuration must reproduce spekula plain's output turn by turn (content and tool calls), else the
run fails.

The model's chat template must know tools on both servers. SmolLM2's own template does not, so by
default both servers get Qwen 2.5's template (ChatML, the same special tokens SmolLM2 has, Hermes-style
`<tool_call>` calls), read from the llama.cpp sources tests use (tests/llamacpp_sdist.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ is not a package
sys.path.insert(0, str(HERE.parent))  # tests/ helpers (the llama.cpp sources)

from llama_server import LlamaServer, find_llama_server, supported_spec_types  # noqa: E402
from prompt_cache import Spekula  # noqa: E402

SESSION = HERE / "data" / "agent_session.json"
TEMPLATE = "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"
CTX = 8192

SPEKULA_CONFIGS: dict[str, list[str]] = {
    "plain": [],
    "spec-default": ["--spec-default"],
    "suffix": ["--spec-type", "suffix"],
    "suffix+ngram-mod": ["--spec-type", "suffix,ngram-mod"],
}
LLAMA_CONFIGS: dict[str, list[str]] = {
    "plain": [],
    "spec-default": ["--spec-default"],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
}


@dataclass(frozen=True)
class Turn:
    """One assistant tool-call turn of the session: the conversation before it and the call it made."""

    messages: list[dict[str, Any]]
    function: str
    recorded_chars: int  # the recorded call's argument text


@dataclass
class TurnResult:
    predicted_n: int
    predicted_ms: float
    prompt_n: int
    cache_n: int
    output: str  # content and tool calls, to compare configurations
    draft_n: int = 0  # draft tokens verified and accepted (the server's timings; 0 when none)
    draft_accepted: int = 0


@dataclass
class Run:
    engine: str
    config: str
    wall_s: float
    turns: list[TurnResult] = field(default_factory=list)

    @property
    def decode_tps(self) -> float:
        return sum(t.predicted_n for t in self.turns) / (sum(t.predicted_ms for t in self.turns) / 1000)


def load_turns(path: Path) -> tuple[list[dict[str, Any]], list[Turn]]:
    session = json.loads(path.read_text())
    msgs = session["messages"]
    turns = [Turn(msgs[:i], m["tool_calls"][0]["function"]["name"], len(m["tool_calls"][0]["function"]["arguments"]))
             for i, m in enumerate(msgs) if m["role"] == "assistant" and m.get("tool_calls")]
    return session["tools"], turns


def template_file(explicit: str | None) -> str:
    if explicit:
        return explicit
    from tests.llamacpp_sdist import read_source

    out = Path(tempfile.gettempdir()) / "spekula-agent-bench-template.jinja"
    out.write_text(read_source(TEMPLATE))
    return str(out)


class LlamaServerWith(LlamaServer):
    """llama-server with options beyond one --spec-type (its --spec-default, --jinja, a template file)."""

    def __init__(self, binary: str, model: str, extra: list[str], *, threads: int) -> None:
        super().__init__(binary, model, spec_type=None, options={}, n_ctx=CTX, n_batch=2048, threads=threads)
        self.extra = extra

    def command(self) -> list[str]:
        return super().command() + self.extra


def post(port: int, body: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=timeout) as r:
        return dict(json.loads(r.read()))


def replay(port: int, tools: list[dict[str, Any]], turns: list[Turn], factor: float) -> list[TurnResult]:
    out = []
    for turn in turns:
        body = {"messages": turn.messages, "tools": tools, "temperature": 0.0, "cache_prompt": True,
                "tool_choice": {"type": "function", "function": {"name": turn.function}},
                # Room for the recorded call (about 3 characters a token) and some more; a model that
                # copies the file stops by itself, one that loops stops here on both servers alike.
                "max_tokens": int(turn.recorded_chars / 3 * factor) + 48}
        answer = post(port, body)
        t = answer["timings"]
        msg = answer["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        out.append(TurnResult(int(t["predicted_n"]), float(t["predicted_ms"]), int(t["prompt_n"]),
                              int(t.get("cache_n", 0)), json.dumps([msg.get("content") or "", calls]),
                              int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))))
    return out


def run_one(engine: str, config: str, args: argparse.Namespace, model: str, template: str,
            tools: list[dict[str, Any]], turns: list[Turn]) -> Run:
    if engine == "spekula":
        extra = ["--chat-template-file", template, *SPEKULA_CONFIGS[config]]
        with Spekula(model, args.threads, extra, ctx=CTX) as server:
            t0 = time.perf_counter()
            results = replay(server.port, tools, turns, args.max_tokens_factor)
    else:
        extra = ["--jinja", "--chat-template-file", template, *LLAMA_CONFIGS[config]]
        with LlamaServerWith(args.llama_binary, model, extra, threads=args.threads) as llama:
            t0 = time.perf_counter()
            results = replay(llama.port, tools, turns, args.max_tokens_factor)
    return Run(engine, config, time.perf_counter() - t0, results)


def report(runs: list[Run], turns: list[Turn]) -> None:
    keys = sorted({(r.engine, r.config) for r in runs}, key=lambda k: (k[0] != "llama", k[1] != "plain", k[1]))
    by: dict[tuple[str, str], list[Run]] = {k: [r for r in runs if (r.engine, r.config) == k] for k in keys}
    med = statistics.median
    print("\n| engine | config | decode tok/s | per turn (tok/s) | session wall s | tokens |")
    print("|---|---|---:|---|---:|---:|")
    for k, rs in by.items():
        per_turn = [med(t.predicted_n / (t.predicted_ms / 1000) for t in ts) for ts in zip(*(r.turns for r in rs), strict=True)]
        print(f"| {k[0]} | {k[1]} | {med(r.decode_tps for r in rs):.1f} | "
              f"{' / '.join(f'{v:.0f}' for v in per_turn)} | {med(r.wall_s for r in rs):.2f} | "
              f"{sum(t.predicted_n for t in rs[0].turns)} |")
    print("\nprompt tokens reused from the cache per turn (cache_n / (cache_n + prompt_n)), first repetition:")
    for k, rs in by.items():
        parts = [f"{t.cache_n}/{t.cache_n + t.prompt_n}" for t in rs[0].turns]
        print(f"  {k[0]:<8} {k[1]:<18} {'  '.join(parts)}")
    print("\ndraft tokens accepted / verified per turn, each repetition:")
    for k, rs in by.items():
        for i, r in enumerate(rs):
            if any(t.draft_n for t in r.turns):
                parts = [f"{t.draft_accepted}/{t.draft_n}" for t in r.turns]
                print(f"  {k[0]:<8} {k[1]:<18} {i + 1}  {'  '.join(parts)}")
    tps = {k: med(r.decode_tps for r in rs) for k, rs in by.items()}

    def best(engine: str) -> tuple[str, float]:
        cands = {c: v for (e, c), v in tps.items() if e == engine and c != "plain"}
        name = max(cands, key=lambda c: cands[c])
        return name, cands[name]

    engines = {k[0] for k in keys}
    if {"spekula", "llama"} <= engines:
        if ("spekula", "spec-default") in tps and ("llama", "spec-default") in tps:
            ratio = tps["spekula", "spec-default"] / tps["llama", "spec-default"]
            print(f"\n--spec-default each: spekula / llama-server decode = **{ratio:.2f}x** (goal >= 3.2x)")
        (sb, sv), (lb, lv) = best("spekula"), best("llama")
        print(f"best each: spekula {sb} / llama-server {lb} = **{sv / lv:.2f}x** (goal >= 4x)")
        if ("spekula", "plain") in tps and ("llama", "plain") in tps:
            print(f"plain each: {tps['spekula', 'plain'] / tps['llama', 'plain']:.2f}x")
    print(f"\n{len(turns)} tool-call turns; load average now {os.getloadavg()[0]:.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF model (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--llama-server", help="llama-server binary (default $SPEKULA_LLAMA_SERVER, then PATH)")
    ap.add_argument("--chat-template-file", help="template both servers use (default: Qwen 2.5's)")
    ap.add_argument("--engines", default="spekula,llama")
    ap.add_argument("--configs", help="configuration names to run (default all of each engine)")
    ap.add_argument("--max-tokens-factor", type=float, default=1.5)
    ap.add_argument("--turns", type=int, help="replay only the first N tool-call turns")
    args = ap.parse_args(argv)
    from spekula.backends.gguf.default_model import ensure_default_model

    model = args.model or str(ensure_default_model(quiet=True))
    tools, turns = load_turns(SESSION)
    turns = turns[: args.turns] if args.turns else turns
    template = template_file(args.chat_template_file)
    engines = args.engines.split(",")
    args.llama_binary = None
    if "llama" in engines:
        args.llama_binary, why = find_llama_server(args.llama_server)
        if args.llama_binary is None:
            print(f"llama-server not run: {why}")
            engines.remove("llama")
    wanted = set(args.configs.split(",")) if args.configs else None
    plan = [(e, c) for e in engines for c in (SPEKULA_CONFIGS if e == "spekula" else LLAMA_CONFIGS)
            if wanted is None or c in wanted]
    if args.llama_binary:
        known = set(supported_spec_types(args.llama_binary, ["ngram-simple", "ngram-map-k", "ngram-mod"]))
        plan = [(e, c) for e, c in plan if e != "llama" or c in ("plain", "spec-default") or c in known]
    runs: list[Run] = []
    for rep in range(args.reps):
        for engine, config in plan:
            run = run_one(engine, config, args, model, template, tools, turns)
            runs.append(run)
            print(f"rep {rep + 1} {engine:<8} {config:<18} {run.decode_tps:7.1f} tok/s decode, "
                  f"{run.wall_s:6.2f} s session", flush=True)
    reference = {tuple(t.output for t in r.turns) for r in runs if r.engine == "spekula" and r.config == "plain"}
    for r in runs:
        if r.engine == "spekula" and reference and tuple(t.output for t in r.turns) not in reference:
            diff = next(i for i, t in enumerate(r.turns) if t.output not in {ref[i] for ref in reference})
            raise SystemExit(f"spekula {r.config}: turn {diff + 1} differs from spekula plain decoding")
    report(runs, turns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
