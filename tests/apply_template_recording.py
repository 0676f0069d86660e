"""llama-server's /apply-template renders of the tool-calling templates, recorded and replayed.

The recordings (tests/data/llama_server_apply_template.json) come from llama.cpp 11434's llama-server
run with ``--jinja --chat-template-file models/templates/NAME.jinja`` on any model file (the template
overrides the model's own); tests/core/test_apply_template_recordings.py compares spekula's render of the
same requests with them, and re-records against a live llama-server when $SPEKULA_LLAMA_SERVER names one.

    SPEKULA_LLAMA_SERVER=/path/llama-server python tests/apply_template_recording.py MODEL.gguf  # re-record
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from live_llama_server import llama_server, post_json

RECORDINGS = Path(__file__).parent / "data" / "llama_server_apply_template.json"
TEMPLATES = (
    "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
    "mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506",
    "mistralai-Ministral-3-14B-Reasoning-2512", "unsloth-mistral-Devstral-Small-2507", "openai-gpt-oss-120b",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-V3.1",
    "meetkai-functionary-medium-v3.1", "meetkai-functionary-medium-v3.2", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen3.5-4B", "Qwen3-Coder", "llama-cpp-deepseek-r1",
)
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["path"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the code",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
# As a client sends it: arguments as JSON text, two parallel calls, their results, then a new question.
LOOP = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What does main.py import?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "main.py"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"query": "import"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "import os\nprint(os.getcwd())"},
    {"role": "tool", "tool_call_id": "call_2", "content": "main.py:1: import os"},
    {"role": "assistant", "content": "It imports os."},
    {"role": "user", "content": "And the second line?"},
]  # fmt: skip
# One call and its result, the id in the nine letters and digits Mistral's templates insist on (Llama 3.x
# refuses two calls at once, Mistral Nemo a user turn right after a tool result).
SINGLE = [
    {"role": "user", "content": "What does main.py import?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "A1b2C3d4E", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "main.py"}'}}]},
    {"role": "tool", "tool_call_id": "A1b2C3d4E", "content": "import os"},
]  # fmt: skip
REQUESTS: dict[str, dict[str, Any]] = {
    "one call": {"messages": SINGLE, "tools": TOOLS},
    "one turn": {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS},
    "tool loop": {"messages": LOOP, "tools": TOOLS},
    "tool loop, thinking off": {"messages": LOOP, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
}


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"prompt": post_json(port, "/apply-template", body, timeout=60)["prompt"]}
    except urllib.error.HTTPError as exc:
        return {"error": exc.code}


def record(binary: str, model: str, template_dir: Path, templates: tuple[str, ...] = TEMPLATES) -> dict[str, Any]:
    """{template: {request name: {"prompt": text} or {"error": status}}} from a live llama-server."""
    out: dict[str, Any] = {}
    for name in templates:
        with llama_server(binary, model, "--jinja", "--chat-template-file", str(template_dir / f"{name}.jinja")) as port:
            out[name] = {what: _post(port, body) for what, body in REQUESTS.items()}
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from llamacpp_sdist import sdist_path

    server, model_path = os.environ["SPEKULA_LLAMA_SERVER"], sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        import tarfile

        with tarfile.open(sdist_path()) as tar:
            members = [m for m in tar.getmembers() if "/models/templates/" in m.name and m.name.endswith(".jinja")]
            for m in members:
                m.name = Path(m.name).name
            tar.extractall(tmp, members=members, filter="data")
        RECORDINGS.write_text(json.dumps(record(server, model_path, Path(tmp)), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {RECORDINGS}")
