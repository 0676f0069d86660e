"""Two-turn chat over HTTP: turn 2's time to first token with and without the prompt cache, for
`spekula serve --port` and (when available) llama-server, on the same model and messages.

Each round runs turn 1 (which fills the slot's cache), then turn 2 with `cache_prompt: true` and,
after re-running turn 1, turn 2 with `cache_prompt: false`; servers alternate round by round and
the medians are printed with the ratios. spekula's turn 2 must give the same text either way.

    .venv/bin/python bench/prompt_cache.py --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_server import LlamaServer, find_llama_server  # noqa: E402

SYSTEM = ("You are a careful assistant for a small engineering team. Answer in plain prose, keep answers "
          "short, say when you are unsure, and prefer concrete steps over general advice.")
TOPICS = [
    "We run a nightly job that copies a 40 GB PostgreSQL database to a reporting server with pg_dump and "
    "pg_restore. It now takes five hours and sometimes overlaps the morning load. What are our options to "
    "make the copy faster or avoid it, and what would you try first?",
    "Our Python service reads a 2 GB CSV file every hour, filters rows by date and writes a summary table. "
    "Memory use peaks at 9 GB and the container gets killed. How would you restructure the job so that it "
    "runs in under 1 GB, and what libraries would you use?",
]
FOLLOW_UP = "Thanks. Which of those would you do this week, and what could go wrong with it?"


def _post_stream(port: int, path: str, body: dict[str, Any], timeout: float = 600) -> tuple[float, str]:
    """(seconds to the first content chunk, the whole streamed text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {resp.read()[:300]!r}")
    first, text = 0.0, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices", []):
            piece = choice.get("delta", {}).get("content")
            if piece:
                if not first:
                    first = time.perf_counter() - t0
                text.append(piece)
    conn.close()
    return first, "".join(text)


def _chat(port: int, messages: list[dict[str, str]], n: int, cache: bool) -> tuple[float, str]:
    body = {"messages": messages, "max_tokens": n, "temperature": 0, "stream": True, "cache_prompt": cache}
    return _post_stream(port, "/v1/chat/completions", body)


def _round(port: int, topic: str, n_predict: int) -> dict[str, Any]:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": topic}]
    _, answer = _chat(port, turn1, n_predict, True)
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    cached, text_cached = _chat(port, turn2, 8, True)
    _chat(port, turn1, n_predict, True)  # the same state as before the cached turn 2
    cold, text_cold = _chat(port, turn2, 8, False)
    return {"cached": cached, "cold": cold, "same": text_cached == text_cold}


class Spekula:
    """`spekula serve --port 0` as a context manager: started, ready (/health 200), terminated.

    Its stderr goes to a file, not a pipe: a server that keeps logging (Ray's processes do) would
    block once a pipe nobody reads filled up."""

    def __init__(self, model: str | None, threads: int, extra: list[str] | None = None, *, ctx: int = 4096) -> None:
        self.model, self.threads, self.extra, self.ctx = model, threads, list(extra or []), ctx
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log = Path(tempfile.mkstemp(prefix="spekula-serve-", suffix=".log")[1])

    def __enter__(self) -> Spekula:
        exe = Path(sys.executable).with_name("spekula")
        cmd = [str(exe), "serve", "--port", "0", "-c", str(self.ctx), "-t", str(self.threads), "--temp", "0"]
        if self.model:
            cmd += ["-m", self.model]
        cmd += self.extra
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stderr=out, stdout=subprocess.DEVNULL,
                                         env={**os.environ, "OMP_NUM_THREADS": str(self.threads)})
        deadline = time.monotonic() + 600
        while not self.port:
            m = re.search(r"listening on http://[\d.]+:(\d+)", self.log.read_text(errors="replace"))
            if m:
                self.port = int(m.group(1))
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"spekula serve did not start: {self.log.read_text()[-3000:]}")
            else:
                time.sleep(0.2)
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"spekula serve did not become ready: {self.log.read_text()[-3000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF model (default: the embedded SmolLM2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-predict", type=int, default=96, help="turn 1's answer length")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: $SPEKULA_LLAMA_SERVER, then PATH)")
    args = ap.parse_args(argv)
    from spekula.backends.gguf.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    binary, why = find_llama_server(args.llama_server)
    servers: dict[str, Any] = {"spekula": Spekula(model, args.threads)}
    if binary:
        servers["llama-server"] = LlamaServer(binary, model, spec_type=None, options={}, n_ctx=4096, n_batch=512,
                                              threads=args.threads, request_timeout=600)
    else:
        print(f"llama-server: not measured ({why})")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for srv in servers.values():
        srv.__enter__()
    try:
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                results[name].append(_round(servers[name].port, TOPICS[r % len(TOPICS)], args.n_predict))
    finally:
        for srv in servers.values():
            srv.__exit__(None, None, None)
    print(f"\nturn-2 time to first token, median of {args.rounds} rounds ({args.threads} threads)")
    print(f"{'server':<14}{'cached ms':>11}{'no cache ms':>13}{'speed-up':>10}{'same text':>11}")
    med: dict[str, tuple[float, float]] = {}
    for name, rows in results.items():
        cached = statistics.median(x["cached"] for x in rows) * 1e3
        cold = statistics.median(x["cold"] for x in rows) * 1e3
        med[name] = (cached, cold)
        same = all(x["same"] for x in rows)
        print(f"{name:<14}{cached:>11.1f}{cold:>13.1f}{cold / cached:>9.2f}x{'yes' if same else 'NO':>11}")
    if "llama-server" in med:
        s, ls = med["spekula"], med["llama-server"]
        print(f"spekula vs llama-server (time ratio, < 1 is faster): cached {s[0] / ls[0]:.2f}x, "
              f"no cache {s[1] / ls[1]:.2f}x")
    return 0 if all(x["same"] for x in results["spekula"]) else 1


if __name__ == "__main__":
    sys.exit(main())
