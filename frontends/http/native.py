"""llama-server's own endpoints: /health, /props, /slots, /completion, /tokenize, /detokenize,
/apply-template, with its field names and response shapes."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from spekula.core.events import Event, FinalEvent, PieceEvent, ProgressEvent
from spekula.frontends.http.errors import HttpError, from_rpc
from spekula.frontends.http.fields import normalise
from spekula.frontends.http.prompts import element_kinds, split_batch
from spekula.frontends.rpc.protocol import RpcError
from spekula.frontends.schema import completion as rp
from spekula.frontends.schema import token_probs_json
from spekula.frontends.schema.tokenize_limits import (
    TokenizeTooLarge,
    check_content,
    check_pieces,
    tokenize_limiter,
)

if TYPE_CHECKING:
    from spekula.frontends.http.state import HttpState

COMPLETION_FIELDS = rp.COMPLETION_FIELDS
# llama-server's stop types; a cancelled request only ends that way when its client is gone.
STOP_TYPES = {"eos": "eos", "limit": "limit", "word": "word", "none": "none", "cancel": "none"}


def generation_settings(state: HttpState, params: Any = None) -> dict[str, Any]:
    """llama-server's `generation_settings`: the request's effective parameters (adaptive-p, which
    spekula does not have, at its off values)."""
    engine = state.engine
    assert engine is not None
    d = state.service.defaults
    s = d.sampling if params is None else params.sampling
    n_predict = d.n_predict if params is None else params.n_predict
    spec = engine.config.spec if params is None or params.spec is None else params.spec
    return {
        "n_predict": n_predict, "max_tokens": n_predict, "seed": s.seed, "temperature": s.temperature,
        "dynatemp_range": s.dynatemp_range, "dynatemp_exponent": s.dynatemp_exponent, "top_k": s.top_k,
        "top_p": s.top_p, "min_p": s.min_p, "top_n_sigma": s.top_n_sigma, "xtc_probability": s.xtc_probability,
        "xtc_threshold": s.xtc_threshold, "typical_p": s.typical_p,
        "repeat_last_n": s.repeat_last_n, "repeat_penalty": s.repeat_penalty, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "min_keep": s.min_keep, "dry_multiplier": s.dry_multiplier,
        "dry_base": s.dry_base, "dry_allowed_length": s.dry_allowed_length, "dry_penalty_last_n": s.dry_penalty_last_n,
        "dry_sequence_breakers": list(s.dry_sequence_breakers), "mirostat": s.mirostat,
        "mirostat_tau": s.mirostat_tau, "mirostat_eta": s.mirostat_eta, "adaptive_target": -1.0,
        "adaptive_decay": 0.9, "stop": [] if params is None else list(params.stop),
        "n_keep": d.n_keep if params is None else params.n_keep, "n_discard": 0 if params is None else params.n_discard,
        "ignore_eos": False if params is None else params.ignore_eos,
        "n_probs": 0 if params is None else params.n_probs,
        "post_sampling_probs": False if params is None else params.post_sampling_probs,
        # as llama-server lists them; a ban (-inf) reads null, as its JSON writer prints it
        "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in s.logit_bias],
        "grammar": "", "samplers": list(s.samplers),
        "speculative.types": list(spec.types), "speculative.n_max": spec.n_max, "speculative.n_min": spec.n_min,
        "speculative.p_min": spec.p_min, "speculative.adaptive": spec.adaptive,
    }


def completion_result(state: HttpState, final: FinalEvent, *, prompt: list[int], params: Any,
                      return_tokens: bool) -> dict[str, Any]:
    engine = state.ready()
    return {
        "index": 0, "content": final.content, "tokens": list(final.tokens) if return_tokens else [],
        "id_slot": final.slot, "stop": True, "model": state.model_alias,
        "tokens_predicted": len(final.tokens), "tokens_evaluated": final.tokens_evaluated,
        "generation_settings": generation_settings(state, params),
        "prompt": engine.tokenizer.decode(prompt),
        "has_new_line": "\n" in final.content, "truncated": final.truncated,
        "stop_type": STOP_TYPES.get(final.stop_type, "none"), "stopping_word": final.stopping_word,
        "tokens_cached": final.tokens_evaluated + max(len(final.tokens) - 1, 0),
        "timings": dict(final.timings),
        **_probabilities(engine.tokenizer, token_probs_json.answer_probs(engine.tokenizer, final)),
    }


def _probabilities(tokenizer: Any, probs: Any) -> dict[str, Any]:
    """llama-server's `completion_probabilities`, for a request that asked for them (n_probs > 0)."""
    return {} if probs is None else {"completion_probabilities": token_probs_json.native(tokenizer, probs)}


def progress_fields(event: ProgressEvent) -> dict[str, Any]:
    """llama-server's `prompt_progress` object (and the timings so far, when asked for)."""
    out: dict[str, Any] = {"prompt_progress": {"total": event.total, "cache": event.cache,
                                               "processed": event.processed, "time_ms": int(event.time_ms)}}
    if event.timings is not None:
        out["timings"] = event.timings
    return out


def pick_fields(result: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: only these (slash-separated) paths, keyed by the path."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = result
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


def response_fields(body: Any) -> list[str]:
    if not isinstance(body, dict):
        return []
    value = body.pop("response_fields", None)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise HttpError("'response_fields' must be a list of strings")
    return value


async def completion(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    body = await state.read_json(request)
    fields = response_fields(body)
    params, opts = normalise(body, allowed=COMPLETION_FIELDS, n_slots=engine.config.n_slots)
    if "prompt" not in params:
        raise HttpError("'prompt' is required")
    prompt = params.pop("prompt")
    raw_prompts = split_batch(prompt, await element_kinds(prompt) if isinstance(prompt, list) else None)
    del prompt
    prompts = [(await state.service.prompt_tokens(p))[0] for p in raw_prompts]
    return await answer(state, request, params, opts, prompts, fields)


async def answer(state: HttpState, request: Request, params: dict[str, Any], opts: Any, prompts: list[list[int]],
                 fields: list[str]) -> Response:
    """Run the prompts (a stream for one streamed prompt) and answer in llama-server's native shape."""
    jobs = [state.service.build(dict(params), p, opts, None) for p in prompts]
    await state.service.check(jobs[0][1])
    if jobs[0][1].stream:
        if len(jobs) > 1:
            raise HttpError("streaming takes one prompt per request")
        return _stream(state, jobs[0], prompts[0])

    def shaped(final: FinalEvent, prompt: list[int], parsed: Any, index: int) -> dict[str, Any]:
        result = completion_result(state, final, prompt=prompt, params=parsed.request,
                                   return_tokens=parsed.return_tokens)
        result["index"] = index
        return pick_fields(result, fields) if fields else result

    if len(jobs) == 1:
        gen, parsed = jobs[0]
        return JSONResponse(shaped(await state.service.run(gen, request), prompts[0], parsed, 0))
    finals = await state.service.run_all([gen for gen, _ in jobs], request)
    return JSONResponse([shaped(f, prompts[i], jobs[i][1], i) for i, f in enumerate(finals)])


def _stream(state: HttpState, job: tuple[Any, Any], prompt: list[int]) -> Response:
    gen, parsed = job
    seen = {"n": 0}

    def shape(event: Event) -> list[Any]:
        if isinstance(event, ProgressEvent):
            return [{"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": event.slot,
                     "tokens_predicted": seen["n"], "tokens_evaluated": len(prompt), **progress_fields(event)}]
        if isinstance(event, PieceEvent):
            seen["n"] += len(event.tokens)
            return [{"index": 0, "content": event.text, "tokens": list(event.tokens), "stop": False,
                     "id_slot": event.slot, "tokens_predicted": seen["n"], "tokens_evaluated": len(prompt),
                     **_probabilities(state.ready().tokenizer, event.probs),
                     **({"timings": event.timings} if event.timings is not None else {})}]
        final = completion_result(state, event, prompt=prompt, params=parsed.request, return_tokens=False)
        final["content"] = ""  # streamed already
        final.pop("completion_probabilities", None)  # so were the probabilities
        return [final]

    return state.service.stream(gen, shape, done_marker=False)  # type: ignore[return-value]


async def tokenize(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    body = await state.read_json(request)
    try:
        rp.reject_unknown(rp.as_object(body, "tokenize"), {"content", "add_special", "parse_special", "with_pieces"},
                          "tokenize")
        content = body.get("content")
        if not isinstance(content, str):
            raise HttpError("'content' must be a string")
        add_special = rp.get_bool(body, "add_special", False)
        parse_special = rp.get_bool(body, "parse_special", True)
        with_pieces = rp.get_bool(body, "with_pieces", False)
        check_content(content)
    except TokenizeTooLarge as exc:
        raise HttpError(exc.message, "payload_too_large_error") from None
    except RpcError as exc:
        raise from_rpc(exc) from None
    del body
    ids = await state.service.encode(content, add_special=add_special, parse_special=parse_special, limit=False)
    del content
    if not with_pieces:
        return await _json_reply({"tokens": ids})
    try:
        check_pieces(len(ids))
    except TokenizeTooLarge as exc:
        raise HttpError(exc.message, "payload_too_large_error") from None
    tok = engine.tokenizer

    def pieces() -> list[dict[str, Any]]:
        out = []
        for t in ids:
            raw = tok.token_bytes(t) if hasattr(tok, "token_bytes") else tok.decode([t]).encode()
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # llama-server sends the bytes of a piece that is not valid UTF-8 alone
            out.append({"id": t, "piece": piece})
        return out

    tokens = (pieces() if len(ids) <= _REPLY_IN_THREAD_TOKENS
              else await anyio.to_thread.run_sync(pieces, limiter=tokenize_limiter(len(ids))))
    return await _json_reply({"tokens": tokens})


# A reply of more tokens than this is built and rendered in a worker thread, off the event loop.
_REPLY_IN_THREAD_TOKENS = 16_384


def _render(content: Any) -> bytes:
    """As Starlette's JSONResponse renders."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


async def _json_reply(content: dict[str, Any]) -> Response:
    """A JSON reply; a long token list is rendered off the event loop (its JSON takes a while)."""
    tokens = content.get("tokens")
    if isinstance(tokens, list) and len(tokens) > _REPLY_IN_THREAD_TOKENS:
        body = await anyio.to_thread.run_sync(_render, content, limiter=tokenize_limiter(len(tokens)))
        return Response(body, media_type="application/json")
    return JSONResponse(content)


async def detokenize(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    body = await state.read_json(request)
    try:
        rp.reject_unknown(rp.as_object(body, "detokenize"), {"tokens"}, "detokenize")
        ids = rp.get_token_list(body.get("tokens", []), "tokens", engine.tokenizer.n_vocab)
    except RpcError as exc:
        raise from_rpc(exc) from None
    return JSONResponse({"content": engine.tokenizer.decode(ids)})


async def apply_template(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    body = await state.read_json(request)
    if not isinstance(body, dict) or "messages" not in body:
        raise HttpError("'messages' is required")
    # the whole chat body, as llama-server parses it: the template options count, the rest is checked
    params, opts = normalise(body, allowed=rp.CHAT_FIELDS, n_slots=engine.config.n_slots)
    return JSONResponse({"prompt": state.render_chat(params.pop("messages"), opts)})


async def health(request: Request) -> Response:
    state: HttpState = request.app.state.http
    status = (await state.live()).health()  # Ray replicas: ok while at least one answers
    if status["status"] != "ok":
        raise HttpError("no engine replica is answering", "unavailable_error")
    # llama-server's body, plus what a Ray deployment reports about its replicas
    return JSONResponse({"status": "ok", **{k: status[k] for k in ("requests_retried", "replicas") if k in status}})


async def props(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = state.ready()
    info = engine.props()
    return JSONResponse({
        "default_generation_settings": {"id": 0, "n_ctx": engine.config.n_ctx, "params": generation_settings(state)},
        "total_slots": engine.config.n_slots,
        "model_alias": state.model_alias,
        "model_path": state.model_path,
        "chat_template": engine.tokenizer.chat_template or "",
        "bos_token": state.special_text("bos"), "eos_token": state.special_text("eos"),
        "modalities": {"vision": False, "audio": False},
        "build_info": f"spekula {state.version}",
        "is_sleeping": False,
        "spekula": info,
    })


async def slots(request: Request) -> Response:
    state: HttpState = request.app.state.http
    engine = await state.live()
    if not state.slots_endpoint:
        raise HttpError("This server does not support slots endpoint. Start it with `--slots`", "not_supported_error")
    out = []
    for s in engine.slots():
        out.append({
            "id": s["id"], "n_ctx": engine.config.n_ctx, "is_processing": s["state"] != "idle",
            "speculative": bool(s["spec_types"]), "state": s["state"],
            "n_prompt_tokens": s["n_prompt"], "n_decoded": s["n_decoded"], "n_cached": s["n_cached"],
            "n_prompt_tokens_cache": s["n_cache_reused"], "spec_types": s["spec_types"],
            "draft_n": s["draft_n"], "draft_n_accepted": s["draft_n_accepted"],
            **({"replica": s["replica"]} if "replica" in s else {}),
        })
    if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in out):
        raise HttpError("no slot available", "unavailable_error")
    return JSONResponse(out)
