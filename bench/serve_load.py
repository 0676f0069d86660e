"""Load test for `spekula serve`: many clients over the Unix socket, with and without speculation.

    .venv/bin/python bench/serve_load.py                       # 8 clients x 25 requests, -np 4, ngram-mod
    .venv/bin/python bench/serve_load.py --clients 2 --requests 3 --n-predict 8   # a quick run

One server process (SmolLM2 by default, greedy) serves both phases; the phase without speculation
sends `speculative.type = none` per request, so the two are measured side by side on the same
process. Every answer is checked against the greedy reference of its prompt (computed once per
distinct prompt, one request at a time, no speculation): a mismatch is a wrong answer, an exception
or a missing reply a lost request. Each phase stops issuing requests at its time budget; requests
not started are reported as skipped, never as passed. Exit status 1 on any lost or wrong request.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spekula.frontends.rpc.client import ServerGoneError, SpekulaClient


def make_prompts(n: int) -> list[str]:
    """Distinct code-rewrite prompts whose continuation repeats earlier text (what n-gram drafters find)."""
    out = []
    for i in range(n):
        body = (f"def accumulate_{i}(values, start={i}):\n"
                f"    total = start\n"
                f"    for index, value in enumerate(values):\n"
                f"        if index % {i + 2} == 0:\n"
                f"            total = total + value * {i + 1}\n"
                f"    return total\n")
        out.append(f"# Original:\n{body}\n# The same function, copied exactly:\n{body.splitlines()[0]}\n")
    return out


@dataclass
class Phase:
    name: str
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: int = 0
    wrong: int = 0
    lost: int = 0
    skipped: int = 0
    wall: float = 0.0
    errors: list[str] = field(default_factory=list)


def run_phase(name: str, sock: str, prompts: list[str], refs: dict[str, list[int]], args: argparse.Namespace,
              spec: dict[str, Any] | None) -> Phase:
    phase = Phase(name)
    lock = threading.Lock()
    deadline = time.monotonic() + args.time_limit / 2

    def client(ci: int) -> None:
        try:
            c = SpekulaClient(sock, timeout=args.time_limit)
        except ServerGoneError as exc:
            with lock:
                phase.lost += args.requests
                phase.errors.append(str(exc))
            return
        with c:
            for r in range(args.requests):
                if time.monotonic() > deadline:
                    with lock:
                        phase.skipped += args.requests - r
                    return
                prompt = prompts[(ci + r) % len(prompts)]
                params: dict[str, Any] = {"n_predict": args.n_predict, "return_tokens": True}
                if spec is not None:
                    params["speculative"] = spec
                t0 = time.perf_counter()
                try:
                    res = c.completion(prompt, **params)
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    with lock:
                        phase.lost += 1
                        phase.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                dt = time.perf_counter() - t0
                with lock:
                    phase.latencies.append(dt)
                    phase.tokens += len(res["tokens"])
                    if res["tokens"] == refs[prompt]:
                        phase.ok += 1
                    else:
                        phase.wrong += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    phase.wall = time.perf_counter() - t0
    return phase


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(phases: list[Phase]) -> None:
    print(f"{'phase':<10} {'ok':>4} {'wrong':>5} {'lost':>4} {'skip':>4} {'tokens':>7} {'wall s':>7} "
          f"{'tok/s':>7} {'req/s':>6} {'p50 s':>7} {'p99 s':>7}")
    for ph in phases:
        n = len(ph.latencies)
        print(f"{ph.name:<10} {ph.ok:>4} {ph.wrong:>5} {ph.lost:>4} {ph.skipped:>4} {ph.tokens:>7} {ph.wall:>7.1f} "
              f"{ph.tokens / ph.wall if ph.wall else 0:>7.2f} {n / ph.wall if ph.wall else 0:>6.2f} "
              f"{pct(ph.latencies, 0.5):>7.2f} {pct(ph.latencies, 0.99):>7.2f}")
    base, spec = phases
    if base.wall and spec.wall and base.tokens and spec.tokens:
        print(f"speculation / no speculation: throughput x{(spec.tokens / spec.wall) / (base.tokens / base.wall):.2f}, "
              f"p50 latency x{pct(spec.latencies, 0.5) / pct(base.latencies, 0.5):.2f}")
    for ph in phases:
        for err in ph.errors[:5]:
            print(f"  {ph.name} error: {err}")


def wait_for_socket(proc: subprocess.Popen[bytes], sock: str, log: Path, seconds: float = 300.0) -> bool:
    """Wait until the server listens on `sock`; on exit or timeout print its log and say False."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            print(log.read_text(), file=sys.stderr)
            return False
        time.sleep(0.2)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=25, help="requests per client and phase")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts")
    ap.add_argument("--n-predict", type=int, default=16)
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds for both phases together")
    ap.add_argument("--ngram-mod", default="8,4,16", metavar="MATCH,MIN,MAX",
                    help="ngram-mod n_match,n_min,n_max (llama.cpp's 24,48,64 rarely fire on short answers)")
    args = ap.parse_args()

    if args.model is None:
        from spekula.backends.gguf.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    n_match, n_min, n_max = args.ngram_mod.split(",")
    prompts = make_prompts(args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        sock, log = os.path.join(tmp, "bench.sock"), Path(tmp) / "server.log"
        cmd = [sys.executable, "-m", "spekula.frontends.cli.main", "serve", "-m", args.model, "--socket", sock,
               "-np", str(args.parallel), "-c", "1024", "--temp", "0", "--spec-type", "ngram-mod",
               "--spec-ngram-mod-n-match", n_match, "--spec-ngram-mod-n-min", n_min, "--spec-ngram-mod-n-max", n_max]
        print("server:", " ".join(cmd[2:]), flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
        try:
            if not wait_for_socket(proc, sock, log):
                return 1
            with SpekulaClient(sock, timeout=args.time_limit) as c:
                t0 = time.perf_counter()
                refs = {p: c.completion(p, n_predict=args.n_predict, return_tokens=True,
                                        speculative={"type": "none"})["tokens"] for p in prompts}
                print(f"references: {len(refs)} prompts in {time.perf_counter() - t0:.1f} s (one at a time)", flush=True)
            phases = [run_phase("no-spec", sock, prompts, refs, args, {"type": "none"})]
            print("phase no-spec done", flush=True)
            phases.append(run_phase("ngram-mod", sock, prompts, refs, args, None))
            with SpekulaClient(sock) as c:
                drafters = c.stats()["drafters"]
            report(phases)
            for name, d in drafters.items():
                rate = d["acc_tokens"] / d["gen_tokens"] if d["gen_tokens"] else 0.0
                print(f"{name}: {d['gen_drafts']} drafts, {d['gen_tokens']} drafted tokens, {d['acc_tokens']} accepted "
                      f"(rate {rate:.3f}), mean acceptance length {d['mean_acc_len']:.2f}")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    bad = sum(ph.lost + ph.wrong for ph in phases)
    print("FAIL" if bad else "OK: no request lost, every answer equals its greedy reference")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
