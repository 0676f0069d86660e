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
import sys
from pathlib import Path
from typing import Any

from live_llama_server import llama_server, post_json

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


def _post(port: int, body: dict[str, Any]) -> list[int]:
    return list(post_json(port, "/completion", body)["tokens"])


def record(binary: str, model: str) -> dict[str, Any]:
    """{case: {"plain": tokens, "budgets": {N: tokens}}} from a live llama-server (greedy)."""
    with llama_server(binary, model) as port:
        out: dict[str, Any] = {}
        for name, prompt, start, ends, message, budgets in CASES:
            base = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "return_tokens": True,
                    "cache_prompt": False}
            out[name] = {"plain": _post(port, base), "budgets": {
                str(n): _post(port, {**base, "reasoning_budget_tokens": n, "reasoning_budget_start_tag": start,
                                     "reasoning_budget_end_tags": ends, "reasoning_budget_message": message})
                for n in budgets}}
        return out


if __name__ == "__main__":
    RECORDINGS.write_text(json.dumps(record(os.environ["SPEKULA_LLAMA_SERVER"], sys.argv[1]), indent=1) + "\n")
    print(f"wrote {RECORDINGS}")
