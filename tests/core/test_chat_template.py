"""Chat templates chosen at start-up (--chat-template, --chat-template-file) and assistant prefills."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from spekula.core.errors import ConfigError
from spekula.core.modelfile.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplateError,
    chat_prompt,
    template_override,
    template_variables,
    with_prefill,
)
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.cli.options import target_tokenizer

PLAIN = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


def test_override_by_name_source_or_file(tmp_path: Path) -> None:
    assert template_override(None, None) is None
    assert template_override("chatml", None) == CHATML_TEMPLATE
    assert template_override(PLAIN, None) == PLAIN
    f = tmp_path / "t.jinja"
    f.write_text(PLAIN)
    assert template_override(None, str(f)) == PLAIN
    assert template_override("llama9", None) == "llama9"  # as llama-server: literal text (with a warning)
    for name, path, word in ((None, str(tmp_path / "no"), "cannot read"),
                             ("{% if %}", None, "does not parse"), ("chatml", str(f), "not both")):
        with pytest.raises(ChatTemplateError, match=word):
            template_override(name, path)


def test_target_tokenizer_takes_the_override(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(PLAIN)
    gguf = GGUFFile(tiny_model_path("llama"))
    tok = target_tokenizer(argparse.Namespace(chat_template=None, chat_template_file=str(f)), gguf)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi[assistant]"
    with pytest.raises(ConfigError, match="does not parse"):
        target_tokenizer(argparse.Namespace(chat_template="{{ x", chat_template_file=None), gguf)


class _Tok:
    chat_template = PLAIN

    def apply_chat_template(self, messages, *, add_generation_prompt=True, **extra):  # type: ignore[no-untyped-def]
        from spekula.core.modelfile.chat_template import render_chat

        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt)


def test_a_final_assistant_message_is_continued() -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    assert chat_prompt(_Tok(), chat) == "[user]hi[assistant]Hel"
    assert chat_prompt(_Tok(), chat[:1]) == "[user]hi[assistant]"
    assert chat_prompt(_Tok(), chat[:1], add_generation_prompt=False) == "[user]hi"
    assert with_prefill(chat[:1]) == (chat[:1], "")
    with pytest.raises(ChatTemplateError, match="2 or more assistant"):
        with_prefill([*chat, {"role": "assistant", "content": "x"}])


def test_template_variables_are_an_object_of_free_names() -> None:
    assert template_variables(None, "x") == {}
    assert template_variables({"enable_thinking": False}, "x") == {"enable_thinking": False}
    for bad, word in (([1], "JSON object"), ({"messages": []}, "messages is set by the request"),
                      ({"add_generation_prompt": True, "a": 1}, "add_generation_prompt")):
        with pytest.raises(ChatTemplateError, match=word):
            template_variables(bad, "'chat_template_kwargs'")


GREETING = "{{ greeting }}|" + PLAIN


def test_server_wide_variables_reach_the_template() -> None:
    gguf = GGUFFile(tiny_model_path("llama"))
    args = argparse.Namespace(chat_template=GREETING, chat_template_file=None, chat_template_kwargs='{"greeting": "hey"}')
    tok = target_tokenizer(args, gguf)
    user = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(user) == "hey|[user]hi[assistant]"
    assert tok.apply_chat_template(user, greeting="yo") == "yo|[user]hi[assistant]"  # a request's own value wins
    for text, word in (("{not json", "not JSON"), ('["a"]', "JSON object"), ('{"eos_token": "x"}', "eos_token")):
        args.chat_template_kwargs = text
        with pytest.raises(ConfigError, match=word):
            target_tokenizer(args, gguf)


def test_without_prefill_a_final_assistant_message_is_a_closed_turn() -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    assert chat_prompt(_Tok(), chat, prefill=False) == "[user]hi[assistant]Hel[assistant]"
    assert chat_prompt(_Tok(), chat, prefill=False, continue_final=True) == "[user]hi[assistant]Hel"
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        chat_prompt(_Tok(), chat[:1], continue_final=True)


def test_variables_llama_server_always_sets() -> None:
    from datetime import datetime

    from spekula.core.modelfile.chat_template import render_chat

    today = datetime.now()
    got = render_chat("{{ enable_thinking }}|{{ date_string }}|{{ datetime }}", [])
    assert got in {f"True|{d.strftime('%d %b %Y')}|{d.strftime('%b %d %Y')}" for d in (today, datetime.now())}
    assert render_chat("{{ enable_thinking }}", [], enable_thinking=False) == "False"
    # Qwen3's switch: off only when a caller sets it false
    qwen = "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
    assert render_chat(qwen, []) == "" and render_chat(qwen, [], enable_thinking=False) == "<think></think>"


def test_an_undefined_variable_added_to_text_is_empty() -> None:
    from spekula.core.modelfile.chat_template import render_chat

    assert render_chat("{{ 'a\\n' + functions }}|{{ functions + 'b' }}", []) == "a\n|b"
    with pytest.raises(ChatTemplateError, match="undefined"):
        render_chat("{{ functions + 1 }}", [])


def test_reasoning_options_become_template_variables() -> None:
    gguf = GGUFFile(tiny_model_path("llama"))
    args = argparse.Namespace(chat_template=None, chat_template_file=None, chat_template_kwargs=None,
                              reasoning="off", reasoning_effort="high")
    assert target_tokenizer(args, gguf).chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "high"}
    args.chat_template_kwargs, args.reasoning = '{"enable_thinking": true}', "auto"
    assert target_tokenizer(args, gguf).chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}


def test_reasoning_effort_of_a_chat_request() -> None:
    from spekula.frontends.http.errors import HttpError
    from spekula.frontends.http.fields import normalise
    from spekula.frontends.schema.completion import CHAT_FIELDS, COMPLETION_FIELDS

    chat = {"messages": [], "chat_template_kwargs": {"reasoning_effort": "low", "x": 1}}
    _, opts = normalise({**chat, "reasoning_effort": "high"}, allowed=CHAT_FIELDS, n_slots=1)
    assert opts.template.template_kwargs == {"reasoning_effort": "high", "x": 1}
    _, opts = normalise({**chat, "reasoning_effort": "none"}, allowed=CHAT_FIELDS, n_slots=1)
    assert opts.template.template_kwargs == {"enable_thinking": False, "x": 1}
    for body, allowed in (({**chat, "reasoning_effort": 3}, CHAT_FIELDS), ({"reasoning_effort": "low"}, COMPLETION_FIELDS)):
        with pytest.raises(HttpError, match="reasoning_effort"):
            normalise(body, allowed=allowed, n_slots=1)
