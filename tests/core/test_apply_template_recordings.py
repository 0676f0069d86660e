"""Tools and tool results rendered as llama-server renders them: every tool-calling family's template of the
llama.cpp 11434 sdist, through spekula's chat path (the messages as the frontends hand them on, then the
template), against llama-server's /apply-template recorded in tests/data/llama_server_apply_template.json
(tests/apply_template_recording.py). A request llama-server refuses is refused here too. With
$SPEKULA_LLAMA_SERVER set, the recordings are first checked against a live llama-server."""

from __future__ import annotations

import json
import os
import re
import tarfile
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from apply_template_recording import RECORDINGS, REQUESTS, TEMPLATES, record
from llamacpp_sdist import read_source, sdist_path

from spekula.core.modelfile.chat_template import ChatTemplateError, chat_prompt, render_chat
from spekula.frontends.schema.chat_messages import MessagesError, chat_messages

# The recordings were made on SmolLM2-135M-Instruct, whose BOS and EOS texts the templates print.
BOS, EOS = "<|im_start|>", "<|im_end|>"
_DATE = re.compile(r"(Today Date: |Current date: )\d\d \w{3} \d{4}")


class _TemplateTokenizer:
    """What the chat path reads of a tokenizer: its template, rendered with SmolLM2's BOS and EOS."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=BOS, eos_token=EOS, **extra)


@cache
def _recordings() -> dict[str, Any]:
    return dict(json.loads(RECORDINGS.read_text()))


def _today(text: str) -> str:
    """The render date llama-server printed, as today's (the templates print the day they render on)."""
    return _DATE.sub(lambda m: m.group(1) + datetime.now().strftime("%d %b %Y"), text)


def _spekula(name: str, request: dict[str, Any]) -> str:
    tok = _TemplateTokenizer(read_source(f"models/templates/{name}.jinja"))
    return chat_prompt(tok, chat_messages(request["messages"]), tools=request["tools"],
                       **request.get("chat_template_kwargs", {}))


def test_every_family_is_recorded() -> None:
    assert sorted(_recordings()) == sorted(TEMPLATES)
    assert all(sorted(cases) == sorted(REQUESTS) for cases in _recordings().values())


@pytest.mark.parametrize("what", sorted(REQUESTS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_render_is_llama_servers(name: str, what: str) -> None:
    recorded = _recordings()[name][what]
    if "error" in recorded:
        with pytest.raises((ChatTemplateError, MessagesError)):
            _spekula(name, REQUESTS[what])
        return
    assert _spekula(name, REQUESTS[what]) == _today(recorded["prompt"])


@pytest.mark.skipif(not os.environ.get("SPEKULA_LLAMA_SERVER"), reason="$SPEKULA_LLAMA_SERVER is not set")
def test_recordings_match_a_live_llama_server(tmp_path: Path) -> None:
    model = os.environ.get("SPEKULA_LLAMA_SERVER_MODEL") or str(Path.home() / ".cache/spekula/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not Path(model).is_file():
        pytest.skip(f"no model file for llama-server at {model} ($SPEKULA_LLAMA_SERVER_MODEL)")
    with tarfile.open(sdist_path()) as tar:
        members = [m for m in tar.getmembers() if m.name.endswith(".jinja") and Path(m.name).stem in TEMPLATES]
        for m in members:
            m.name = Path(m.name).name
        tar.extractall(tmp_path, members=members, filter="data")
    live = record(os.environ["SPEKULA_LLAMA_SERVER"], model, tmp_path)
    for name, cases in live.items():
        for what, got in cases.items():
            want = _recordings()[name][what]
            assert {k: _today(v) if isinstance(v, str) else v for k, v in got.items()} == \
                {k: _today(v) if isinstance(v, str) else v for k, v in want.items()}, (name, what)
