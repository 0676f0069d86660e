"""A positive reasoning budget end to end: an OpenAI chat request on the tiny fixture (a real engine, its
template swapped for one that opens <think>) is forced to close its reasoning after the budget, with the
message, the same with speculation as without, streamed as unstreamed."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from asgi_helpers import asgi
from toy_backend import make_engine

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import SamplingParams, SpecParams
from spekula.fixtures.tiny_gguf import tiny_model_path
from spekula.frontends.http.app import build_app
from spekula.frontends.http.generation import GenerationService
from spekula.frontends.http.state import HttpState
from spekula.frontends.schema import completion as rp

THINKING = ("{% for m in messages %}{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %} [assistant]\n<think>\n{% endif %}")
USER = [{"role": "user", "content": "hi"}]


async def _chat(types: tuple[str, ...], body: dict[str, Any]) -> dict[str, Any] | str:
    path = str(tiny_model_path("llama"))
    tok = Tokenizer.from_gguf(GGUFFile(path))
    tok.chat_template = THINKING
    engine = make_engine(load_backend("native", path, BackendOptions(n_ctx=256, n_seq_max=1, threads=1)), tok,
                         n_ctx=256, spec=SpecParams(types=types), draft_model_path=path)
    state = HttpState()
    app = build_app(state)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        state.attach(engine, GenerationService(engine, rp.ServerDefaults(sampling=SamplingParams(temperature=0.0),
                                                                         reasoning_budget_message=" Stop."), 5.0))
        status, _, raw = await asgi(app, "POST", "/v1/chat/completions", json.dumps({"messages": USER, **body}).encode())
        tg.cancel_scope.cancel()
    engine.close()
    assert status == 200, raw
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ") and "[DONE]" not in line]
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return dict(json.loads(raw)["choices"][0]["message"])


@pytest.mark.parametrize("budget", [1, 3])
def test_chat_reasoning_is_cut_at_the_budget_with_every_drafter(budget: int) -> None:
    body = {"max_tokens": 24, "reasoning_budget_tokens": budget, "reasoning_format": "none"}
    plain = anyio.run(_chat, (), body)
    assert isinstance(plain, dict) and " Stop.</think>" in plain["content"]
    for types in (("ngram-simple",), ("suffix",), ("draft-simple",)):
        assert anyio.run(_chat, types, body) == plain, types
    assert anyio.run(_chat, ("draft-simple",), {**body, "stream": True}) == plain["content"]
    unlimited = anyio.run(_chat, (), {**body, "reasoning_budget_tokens": -1})
    assert isinstance(unlimited, dict) and " Stop." not in unlimited["content"]
    # the text before the forced message is what the model wrote unhindered
    cut = plain["content"].index(" Stop.</think>")
    assert unlimited["content"].startswith(plain["content"][:cut])
