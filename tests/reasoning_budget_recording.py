"""llama-server's reasoning budget, recorded and replayed: greedy /completion outputs of llama.cpp 11434's
llama-server on SmolLM2-135M-Instruct with and without `reasoning_budget_tokens` (its native fields name the
start tag, end tags and message), in tests/data/llama_server_reasoning_budget.json.
tests/core/test_reasoning_budget_recordings.py replays them through spekula's state machine, and re-records
against a live llama-server when $SPEKULA_LLAMA_SERVER names one.

    SPEKULA_LLAMA_SERVER=/path/llama-server python tests/reasoning_budget_recording.py MODEL.gguf  # re-record
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

RECORDINGS = Path(__file__).parent / "data" / "llama_server_reasoning_budget.json"
N_PREDICT = 48
# (name, prompt, start tag, end tags, message, budgets): tags common in SmolLM2's greedy text, so blocks open
CASES: list[tuple[str, str, str, list[str], str, list[int]]] = [
    ("the-to-period", "The sky is blue because", " the", ["."], " OK", [1, 3, 8]),
    ("two-ends-no-message", "The sky is blue because", " the", [".", " and"], "", [2, 5]),
    ("multi-token-start", "The sky is blue because", " the way", ["."], " Enough thinking", [0, 4]),
    # byte tokens of split characters: forcing waits for a token that ends a character (WAITING_UTF8)
    ("split-characters", "天空为什么是蓝色的？", "\n", ["。"], " 好", [1, 2, 3, 4, 6]),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, body: dict[str, Any]) -> list[int]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with opener.open(req, timeout=120) as r:
        return list(json.loads(r.read())["tokens"])


def record(binary: str, model: str) -> dict[str, Any]:
    """{case: {"plain": tokens, "budgets": {N: tokens}}} from a live llama-server (greedy)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "512",
                                 "-np", "1", "-t", "1", "--no-webui"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                            f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(f"llama-server did not start: {log.read()[-800:]!r}") from None
                    time.sleep(0.2)
            out: dict[str, Any] = {}
            for name, prompt, start, ends, message, budgets in CASES:
                base = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "return_tokens": True,
                        "cache_prompt": False}
                out[name] = {"plain": _post(port, base), "budgets": {
                    str(n): _post(port, {**base, "reasoning_budget_tokens": n, "reasoning_budget_start_tag": start,
                                         "reasoning_budget_end_tags": ends, "reasoning_budget_message": message})
                    for n in budgets}}
            return out
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    RECORDINGS.write_text(json.dumps(record(os.environ["SPEKULA_LLAMA_SERVER"], sys.argv[1]), indent=1) + "\n")
    print(f"wrote {RECORDINGS}")
