"""An HTTP app over an engine whose replies are scripted (a model's canned output, as llama.cpp's
tests/test-chat.cpp has them), with a real chat template: the frontends' request and reply shapes are
what is tested, whatever a model would write. Also the SSE readers the API tests share."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import cache
from typing import Any

from asgi_helpers import asgi
from llamacpp_sdist import read_source
from toy_backend import ToyBackend, ToyTokenizer, make_engine

from spekula.core.events import Event, FinalEvent, PieceEvent
from spekula.core.modelfile.chat_template import render_chat
from spekula.core.params import SamplingParams
from spekula.frontends.http.app import build_app
from spekula.frontends.http.generation import GenerationService
from spekula.frontends.http.state import HttpState
from spekula.frontends.schema import completion as rp


@cache
def template(name: str) -> str:
    """One of llama.cpp's models/templates/NAME.jinja."""
    return read_source(f"models/templates/{name}.jinja")


class TemplateTokenizer(ToyTokenizer):
    """The toy vocabulary with a real chat template; prompts and requests are remembered."""

    def __init__(self, chat_template: str | None) -> None:
        super().__init__()
        self.chat_template = chat_template
        self.chat_template_kwargs: dict[str, Any] = {}
        self.prompts: list[str] = []
        self.requests: list[Any] = []  # what the engine was asked
        self.encoded: list[str] = []  # the prompts as encoded (after the route's own additions)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        text = render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **extra)
        self.prompts.append(text)
        return text

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self.encoded.append(text)
        return [1, 2, 3]


class Scripted:
    """An engine request that answers `reply` in pieces of `step` characters."""

    def __init__(self, reply: str, step: int) -> None:
        self.id, self.final, self.reply, self.step = "r0", None, reply, step

    async def __aiter__(self) -> AsyncIterator[Event]:
        for i in range(0, len(self.reply), self.step):
            yield PieceEvent("r0", [1], self.reply[i:i + self.step], [None])
        yield await self.result()

    async def result(self) -> FinalEvent:
        self.final = FinalEvent("r0", self.reply, [1] * len(self.reply), "eos")  # type: ignore[arg-type]
        return self.final

    def cancel(self) -> None:
        pass


def scripted_app(chat_template: str | None, reply: str, step: int = 4,
                 reasoning_format: str = "auto") -> tuple[Any, TemplateTokenizer]:
    tok = TemplateTokenizer(chat_template)
    engine = make_engine(ToyBackend(), tok, n_slots=2)

    def submit(req: Any, session: str | None = None) -> Scripted:
        tok.requests.append(req)
        return Scripted(reply, step)

    engine.submit = submit  # type: ignore[method-assign]
    state = HttpState()
    defaults = rp.ServerDefaults(sampling=SamplingParams(temperature=0.0), reasoning_format=reasoning_format)
    state.attach(engine, GenerationService(engine, defaults, 5.0))
    return build_app(state), tok


async def post(app: Any, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """A JSON answer, or a stream's events (`data:` payloads, [DONE] left out)."""
    status, _, raw = await asgi(app, "POST", path, json.dumps(body).encode())
    if body.get("stream") and status == 200:
        return status, sse_data(raw.decode())
    return status, json.loads(raw)


def sse_data(text: str) -> list[Any]:
    out = []
    for line in text.split("\n"):
        if line.startswith("data: ") and line[6:] != "[DONE]":
            out.append(json.loads(line[6:]))
    return out
