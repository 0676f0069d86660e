"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Streams are server-sent events ending with `data: [DONE]`; with `stream_options.include_usage`
the last chunk before it has empty `choices` and the `usage` object, as OpenAI sends it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from spekula.core.events import Event, FinalEvent, PieceEvent, ProgressEvent
from spekula.frontends.http.chat_tools import (
    chat_budget,
    chat_reply_format,
    force_calls,
    limit_reasoning,
    messages_with_tools,
    read_chat_tools,
    without_reasoning,
)
from spekula.frontends.http.errors import HttpError
from spekula.frontends.http.fields import normalise
from spekula.frontends.http.native import completion_result, progress_fields
from spekula.frontends.schema import completion as rp
from spekula.frontends.schema import token_probs_json as tpj
from spekula.frontends.schema.chat_reply import (
    Reply,
    ReplyFormat,
    ReplyStream,
    limited,
    openai_message,
    parse_reply,
    with_ids,
)

if TYPE_CHECKING:
    from spekula.frontends.http.state import HttpState

_OPENAI_COMMON = (rp.COMPLETION_FIELDS - {"prompt"})
COMPLETION_FIELDS = _OPENAI_COMMON | {"prompt"}
CHAT_FIELDS = _OPENAI_COMMON | {"messages"}


def finish_reason(final: FinalEvent, reply: Reply | None = None) -> str:
    """llama-server's: "length" at the token limit, else "tool_calls" when the reply calls tools."""
    if final.stop_type == "limit":
        return "length"
    return "tool_calls" if reply is not None and reply.tool_calls else "stop"


def _chat_choice(index: int, final: FinalEvent, fmt: ReplyFormat, parallel: bool,
                 logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """One unstreamed chat choice: the reply split into content, reasoning and tool calls."""
    if not fmt.active:
        return {"index": index, "message": {"role": "assistant", "content": final.content}, "logprobs": logprobs,
                "finish_reason": finish_reason(final)}
    reply = with_ids(limited(parse_reply(final.content, fmt), parallel), [])
    return {"index": index, "message": openai_message(reply), "logprobs": logprobs,
            "finish_reason": finish_reason(final, reply)}


def usage(final: FinalEvent) -> dict[str, Any]:
    n_prompt, n_out = final.tokens_evaluated, len(final.tokens)
    return {"completion_tokens": n_out, "prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": int(final.timings.get("cache_n", 0))}}


async def models(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    info = engine.backend.info
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_alias, "object": "model", "created": state.created, "owned_by": "spekula",
        "meta": {"n_vocab": info.n_vocab, "n_ctx": engine.config.n_ctx, "n_embd": getattr(info, "n_embd", None),
                 "n_layer": info.n_layer},
    }]})


async def completions(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    params, opts = normalise(await state.read_json(request), allowed=COMPLETION_FIELDS, n_slots=engine.config.n_slots)
    if "prompt" not in params:
        raise HttpError("'prompt' is required")
    prompt, text = await state.service.prompt_tokens(params.pop("prompt"))
    gen, parsed = state.service.build(params, prompt, opts, text)
    await state.service.check(parsed)
    cid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
    if parsed.stream and opts.n > 1:
        raise HttpError("'n' > 1 is not supported with streaming")

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": cid, "object": "text_completion", "created": created, "model": state.model_alias,
                "system_fingerprint": state.fingerprint, "choices": [choice]}

    tok = engine.tokenizer

    def logprobs(probs: Any, offset: int = 0) -> dict[str, Any] | None:
        return None if probs is None else tpj.openai_completion(tok, tpj.shown(tok, probs), offset)

    if parsed.stream:
        offset = [0]

        def shape(event: Event) -> list[Any]:
            if isinstance(event, ProgressEvent):
                return [{**chunk({"text": "", "index": 0, "logprobs": None, "finish_reason": None}),
                         **progress_fields(event)}]
            if isinstance(event, PieceEvent):
                lp = logprobs(event.probs, offset[0])
                if lp is not None:
                    offset[0] += sum(len(t) for t in lp["tokens"])
                if not event.text and not (lp and lp["tokens"]):
                    return []
                return [{**chunk({"text": event.text, "index": 0, "logprobs": lp, "finish_reason": None}),
                         **_timings(event)}]
            out = [chunk({"text": "", "index": 0, "logprobs": None, "finish_reason": finish_reason(event)})]
            return _close(out, chunk({}), event, opts.include_usage)

        return state.service.stream(gen, shape, done_marker=True)  # type: ignore[return-value]
    return await _answer(state, request, chunk({}), gen, parsed, params, prompt, opts, text,
                         lambda i, f: {"text": f.content, "index": i, "logprobs": logprobs(tpj.answer_probs(tok, f)),
                                       "finish_reason": finish_reason(f)})


async def chat_completions(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    body = await state.read_json(request)
    params, opts = normalise(body, allowed=CHAT_FIELDS, n_slots=engine.config.n_slots)
    tools, tool_opts = await read_chat_tools(body, engine, state.service.defaults.reasoning_format)
    budget = chat_budget(opts, state.service.defaults)
    text = state.render_chat(messages_with_tools(engine, params.pop("messages", None), tools, tool_opts), opts)
    text = without_reasoning(engine, text, budget)
    fmt = chat_reply_format(engine, text, tools, tool_opts)
    prompt = await state.service.encode(text)
    gen, parsed = state.service.build(params, prompt, opts, text)
    force_calls(gen, parsed, fmt, tools, tool_opts, engine.tokenizer)
    limit_reasoning(gen, engine, budget, opts, state.service.defaults)
    await state.service.check(parsed)
    cid, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
    if parsed.stream and opts.n > 1:
        raise HttpError("'n' > 1 is not supported with streaming")

    def chunk(choice: dict[str, Any], obj: str = "chat.completion.chunk") -> dict[str, Any]:
        return {"id": cid, "object": obj, "created": created, "model": state.model_alias,
                "system_fingerprint": state.fingerprint, "choices": [choice]}

    tok = engine.tokenizer

    def logprobs(probs: Any) -> dict[str, Any] | None:
        return None if probs is None else tpj.openai_chat(tok, tpj.shown(tok, probs))

    if parsed.stream:
        first = [True]
        replies = ReplyStream(fmt, tool_opts.parallel)

        def shape(event: Event) -> list[Any]:
            out: list[Any] = []
            if isinstance(event, ProgressEvent):  # as llama-server: the role's chunk, carrying the progress
                return [{**chunk({"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                                  "finish_reason": None}), **progress_fields(event)}]
            if first[0]:
                first[0] = False
                out.append(chunk({"index": 0, "delta": {"role": "assistant", "content": None},
                                  "logprobs": None, "finish_reason": None}))
            if isinstance(event, PieceEvent):
                lp = logprobs(event.probs)
                deltas = replies.feed(event.text) if fmt.active else [{"content": event.text}] if event.text else []
                if not deltas and lp and lp["content"]:
                    deltas = [{}]  # the probabilities of tokens held back (the start of a tag or a call)
                for j, delta in enumerate(deltas):
                    out.append({**chunk({"index": 0, "delta": delta, "logprobs": lp if j == 0 else None,
                                         "finish_reason": None}), **_timings(event)})
                return out
            if fmt.active:
                out.extend(chunk({"index": 0, "delta": d, "logprobs": None, "finish_reason": None})
                           for d in replies.feed("", final=event.content))
            out.append(chunk({"index": 0, "delta": {}, "logprobs": None,
                              "finish_reason": finish_reason(event, replies.reply if fmt.active else None)}))
            return _close(out, chunk({}), event, opts.include_usage)

        return state.service.stream(gen, shape, done_marker=True)  # type: ignore[return-value]
    return await _answer(state, request, chunk({}, obj="chat.completion"), gen, parsed, params, prompt, opts, text,
                         lambda i, f: _chat_choice(i, f, fmt, tool_opts.parallel, logprobs(tpj.answer_probs(tok, f))))


async def input_tokens(request: Request) -> Response:
    """How many tokens the chat prompt of these messages takes (llama-server's token count)."""
    state: HttpState = request.app.state.http
    engine = state.ready()
    params, opts = normalise(await state.read_json(request), allowed=CHAT_FIELDS, n_slots=engine.config.n_slots)
    text = state.render_chat(params.pop("messages", None), opts)
    return JSONResponse({"input_tokens": len(await state.service.encode(text)), "object": "response.input_tokens"})


async def _answer(state: HttpState, request: Request, body: dict[str, Any], gen: Any, parsed: Any,
                  params: dict[str, Any], prompt: list[int], opts: Any, text: str | None,
                  choice: Callable[[int, FinalEvent], dict[str, Any]]) -> Response:
    """A whole (non-streamed) OpenAI answer: the `n` generations as `choices`, usage, timings."""
    finals = await state.service.run_all(_copies(state, gen, params, prompt, opts, text), request)
    body["choices"] = [choice(i, f) for i, f in enumerate(finals)]
    body.update(usage=_usage_all(finals), timings=dict(finals[0].timings))
    if opts.verbose or state.verbose:
        body["__verbose"] = completion_result(state, finals[0], prompt=prompt, params=parsed.request,
                                              return_tokens=parsed.return_tokens)
    return JSONResponse(body)


def _timings(event: PieceEvent) -> dict[str, Any]:
    return {"timings": event.timings} if event.timings is not None else {}


def _close(out: list[Any], usage_chunk: dict[str, Any], final: FinalEvent, include_usage: bool) -> list[Any]:
    """The end of a stream: `timings` ride on its last event, the usage chunk when there is one."""
    if include_usage:
        out.append({**usage_chunk, "choices": [], "usage": usage(final)})
    out[-1]["timings"] = dict(final.timings)
    return out


def _copies(state: HttpState, gen: Any, params: dict[str, Any], prompt: list[int], opts: Any,
            text: str | None) -> list[Any]:
    """`n` generations of one prompt; each copy after the first is a request of its own (its own slot)."""
    out = [gen]
    for _ in range(opts.n - 1):
        copy, _parsed = state.service.build(dict(params), prompt, opts, text)
        copy.request.id_slot = -1
        copy.request.grammar = gen.request.grammar  # one set by the route itself (a forced tool_choice) too
        out.append(copy)
    return out


def _usage_all(finals: list[FinalEvent]) -> dict[str, Any]:
    u = usage(finals[0])
    n_out = sum(len(f.tokens) for f in finals)
    u.update(completion_tokens=n_out, total_tokens=u["prompt_tokens"] + n_out)
    return u
