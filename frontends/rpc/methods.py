"""The spekula JSON-RPC methods, driving the Engine API (docs/architecture.md, "The interfaces between layers").

Used by the socket server and, in-process, by the TUI's embedded mode, so both speak exactly the
same request and result shapes.

Protocol (JSON-RPC 2.0, one JSON value per line, named params only, batches allowed):
  completion        prompt (string | token ids), n_predict, temperature, top_k, top_p, min_p,
                    repeat_penalty, repeat_last_n, seed, stop, stream, return_tokens, ignore_eos,
                    cache_prompt (default true: reuse a slot's cached prefix), id_slot (-1: any),
                    speculative.{n_max,n_min,p_min,type} (flat keys or a nested "speculative" object),
                    n_probs (> 0: each token's probability and this many alternatives),
                    post_sampling_probs (after the sampler chain instead of before)
                    -> {request_id, content, stop, stop_type, stopping_word, tokens_predicted,
                        tokens_evaluated, timings, [tokens], [completion_probabilities]}
                    stream=true first sends `completion.chunk` notifications
                    {id (the request's JSON-RPC id), request_id, content, tokens, pieces, drafters,
                     [completion_probabilities] (then absent from the result)}
  chat.completion   messages [{role, content, tool_calls?, tool_call_id?, reasoning_content?}], tools,
                    tool_choice, parallel_tool_calls, reasoning_format, chat_template_kwargs,
                    add_generation_prompt, continue_final_message, reasoning_budget_tokens (or
                    thinking_budget_tokens), reasoning_budget_message (as the HTTP chat endpoint checks them;
                    tool_choice "required" / named forces the calls by a grammar) + the same fields
                    except prompt
                    -> completion's result + message (OpenAI's: {role: assistant, content,
                       reasoning_content?, tool_calls?}) + finish_reason ("tool_calls" when it calls)
                    stream=true: each `completion.chunk` also carries `deltas`, the reply's OpenAI chat
                    deltas (content, reasoning_content, tool_calls in OpenAI's fragment form: index, id
                    and name first, then pieces of the arguments); a last chunk with no tokens carries
                    the text held back until the reply ended
  tokenize          content, add_special=false, parse_special=true, with_pieces=false -> {tokens}
  detokenize        tokens -> {content}
  cancel            id (a JSON-RPC id of this connection) | request_id (an engine id this connection
                    started) -> {cancelled}; the cancelled request still answers, with its partial
                    result and stop_type "cancel". Another client's requests cannot be cancelled.
  stats · slots · health · props   engine and server state (no params)
Errors: -32700 parse, -32600 invalid request (also a line over --max-line-bytes: it is discarded and
the connection stays open), -32601 unknown method, -32602 invalid params (the message names the
field), -32001 prompt does not fit the context, -32002 shutting down, -32003 duplicate in-flight id,
-32000 engine error, -32603 internal error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from spekula.core.events import FinalEvent, PieceEvent
from spekula.core.modelfile.chat_template import ChatTemplateError, chat_prompt
from spekula.frontends.rpc.dispatch import CallContext, Handler
from spekula.frontends.rpc.parse_off_loop import parse_limiter
from spekula.frontends.rpc.protocol import CONTEXT_OVERFLOW, ENGINE_ERROR, EncodedResult, RpcError, dumps
from spekula.frontends.schema import completion as rp
from spekula.frontends.schema import token_probs_json
from spekula.frontends.schema.chat_reply import openai_message
from spekula.frontends.schema.errors import invalid_params
from spekula.frontends.schema.reasoning_budget import (
    BUDGET_FIELDS,
    UNLIMITED,
    ReasoningBudgetError,
    read_budget_fields,
    token_budget,
    without_open_reasoning,
)
from spekula.frontends.schema.reply_fragments import ReplyFragments, openai_delta, whole_reply
from spekula.frontends.schema.template_fields import TEMPLATE_FIELDS, TemplateFieldError, read_template_fields
from spekula.frontends.schema.tokenize_limits import check_content, check_pieces, tokenize_limiter
from spekula.frontends.schema.tool_request import ToolFieldError
from spekula.frontends.schema.tool_setup import (
    calls_grammar,
    check_tool_schemas,
    field_of,
    read_tools,
    tool_messages,
    tool_reply_format,
)

if TYPE_CHECKING:
    from spekula.core.engine.engine import Engine

CHUNK_METHOD = "completion.chunk"
# Tokenizing megabytes of text takes long enough to stall other clients; do it off the loop.
_THREAD_TOKENIZE_CHARS = 16_384
# Token lists longer than this are checked in a worker thread: a line of 8 MiB holds about 4 million
# ids, whose check would hold the event loop (and every other client, /health included) for 0.1-0.3 s.
_THREAD_TOKEN_LIST = 65_536
T = TypeVar("T")
# Texts are capped before tokenizing: no tokenizer in use packs more characters than this into one
# token, so a longer text cannot fit the context whatever it holds.
MAX_CHARS_PER_TOKEN = 64
# chat.completion's tool fields beside `tools` (a template field)
TOOL_FIELDS = frozenset({"tool_choice", "parallel_tool_calls", "reasoning_format"})


def _template_options(obj: dict[str, Any]) -> dict[str, Any]:
    """chat_prompt's keyword arguments from the request's template fields (frontends/schema/template_fields.py)."""
    try:
        fields = read_template_fields(obj)
    except TemplateFieldError as exc:
        raise invalid_params(str(exc), exc.field) from None
    return {"add_generation_prompt": fields.add_generation_prompt, "continue_final": fields.continue_final,
            **fields.variables()}


class SpekulaMethods:
    def __init__(
        self,
        engine: Engine,
        defaults: rp.ServerDefaults | None = None,
        *,
        server_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.engine = engine
        self.defaults = defaults or rp.ServerDefaults()
        self._server_state = server_state or dict
        self._clients: dict[str, Any] = {}  # engine request id -> the client's PeerCred (or None)

    def table(self) -> dict[str, Handler]:
        return {
            "completion": self.completion,
            "chat.completion": self.chat_completion,
            "tokenize": self.tokenize,
            "detokenize": self.detokenize,
            "stats": self.stats,
            "slots": self.slots,
            "health": self.health,
            "cancel": self.cancel,
            "props": self.props,
        }

    # -- generation -------------------------------------------------------------------------

    async def completion(self, params: Any, ctx: CallContext) -> dict[str, Any]:
        obj = rp.as_object(params, "completion")
        rp.reject_unknown(obj, rp.COMPLETION_FIELDS, "completion")
        raw = await self._off_loop_if_long(obj.get("prompt"), rp.prompt_field, obj, self.engine.tokenizer.n_vocab)
        prompt = raw if isinstance(raw, list) else await self._encode(raw)
        return await self._generate(self._parse(obj, prompt), ctx)

    async def chat_completion(self, params: Any, ctx: CallContext) -> dict[str, Any]:
        obj = rp.as_object(params, "chat.completion")
        rp.reject_unknown(obj, rp.CHAT_FIELDS | TEMPLATE_FIELDS | TOOL_FIELDS | BUDGET_FIELDS, "chat.completion")
        messages = rp.messages_field(obj)
        options = _template_options(obj)  # outside the try below: a bad field is named as itself
        try:
            budget, message = read_budget_fields(obj)
        except ReasoningBudgetError as exc:
            raise invalid_params(str(exc), str(exc)[1:].split("'", 1)[0]) from None
        budget = self.defaults.reasoning_budget if budget == UNLIMITED else budget
        if budget == 0:  # no reasoning (frontends/schema/reasoning_budget.py)
            options["enable_thinking"] = False
        tok = self.engine.tokenizer
        try:
            tools, tool_opts = read_tools(obj, tok, self.defaults.reasoning_format)
            await check_tool_schemas(tools, self.engine)
        except ToolFieldError as exc:
            raise invalid_params(str(exc), field_of(exc)) from None
        try:
            text = chat_prompt(tok, tool_messages(tok, messages, tools, tool_opts),
                               prefill=self.defaults.prefill_assistant, **options)
        except ChatTemplateError as exc:
            raise invalid_params(f"'messages': {exc}", "messages") from None
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's message shape
            raise invalid_params(f"'messages': chat template failed: {exc}") from None
        if budget == 0:
            text = without_open_reasoning(tok, text)
        fmt = tool_reply_format(tok, text, tools, tool_opts)
        parsed = self._parse(obj, await self._encode(text))
        parsed.request.reasoning_budget = token_budget(tok, budget, self.defaults.reasoning_budget_message
                                                       if message is None else message)
        try:
            grammar = calls_grammar(fmt, tools, tool_opts, tok, grammar_given=parsed.grammar_field
                                     if parsed.request.grammar is not None else None)
        except ToolFieldError as exc:
            raise invalid_params(str(exc), field_of(exc)) from None
        if grammar is not None:
            parsed.request.grammar, parsed.grammar_field = grammar, "tool_choice"
        fragments = ReplyFragments(fmt, tool_opts.parallel) if fmt.active else None
        result = await self._generate(parsed, ctx, fragments)
        if fragments is None:
            result["message"] = {"role": "assistant", "content": result["content"]}
            calls = False
        else:
            # streamed: the reply the chunks added up to (the same call ids); else parsed now
            reply = fragments.reply if parsed.stream else whole_reply(result["content"], fmt, tool_opts.parallel)
            result["message"] = openai_message(reply)
            calls = bool(reply.tool_calls)
        result["finish_reason"] = "length" if result["stop_type"] == "limit" else "tool_calls" if calls else "stop"
        return result

    def _parse(self, obj: dict[str, Any], prompt: list[int]) -> rp.ParsedCompletion:
        cfg = self.engine.config
        return rp.parse_completion(obj, prompt, defaults=self.defaults, spec_base=cfg.spec, n_ctx=cfg.n_ctx,
                                   n_slots=cfg.n_slots, tokenizer=self.engine.tokenizer)

    @staticmethod
    async def _off_loop_if_long(value: Any, check: Callable[..., T], *args: Any) -> T:
        """`check(*args)`, in a worker thread when `value` is a long list."""
        if isinstance(value, list) and len(value) > _THREAD_TOKEN_LIST:
            return await anyio.to_thread.run_sync(lambda: check(*args), limiter=parse_limiter())
        return check(*args)

    async def _encode(self, text: str, *, add_special: bool = True, parse_special: bool = True,
                      prompt: bool = True) -> list[int]:
        """Token ids of `text`; long texts off the event loop (the tokenizer releases the GIL there). A
        prompt that could not fit any slot is refused before any tokenizing (at most
        MAX_CHARS_PER_TOKEN characters per context position); `tokenize` has no such cap."""
        tok = self.engine.tokenizer
        limit = MAX_CHARS_PER_TOKEN * self.engine.config.n_ctx
        if prompt and len(text) > limit:
            raise RpcError(CONTEXT_OVERFLOW, f"text of {len(text)} characters cannot fit a context of "
                           f"{self.engine.config.n_ctx} tokens (the limit is {limit} characters)",
                           {"n_chars": len(text), "n_ctx": self.engine.config.n_ctx})
        if len(text) > _THREAD_TOKENIZE_CHARS:
            return await anyio.to_thread.run_sync(
                lambda: tok.encode(text, add_special=add_special, parse_special=parse_special),
                limiter=tokenize_limiter(len(text)))
        return tok.encode(text, add_special=add_special, parse_special=parse_special)

    async def _generate(self, parsed: rp.ParsedCompletion, ctx: CallContext,
                        fragments: ReplyFragments | None = None) -> dict[str, Any]:
        """Run the request; `fragments`: a chat reply's parser, whose deltas ride on the streamed chunks."""
        await rp.check_grammar(parsed, self.engine)
        handle = self.engine.submit(parsed.request)
        if not parsed.stream:
            handle.final_only()  # the pieces would be read and dropped below: do not send them
        ctx.on_cancel = handle.cancel
        owned = ctx.connection.owned_requests if ctx.connection is not None else None
        if owned is not None:
            owned[handle.id] = ctx.id
            self._clients[handle.id] = ctx.connection.peer if ctx.connection is not None else None
        final: FinalEvent | None = None
        try:
            async for event in handle:
                if isinstance(event, PieceEvent):
                    if parsed.stream:
                        chunk = chunk_params(ctx.id, event, self.engine.tokenizer)
                        if fragments is not None:
                            chunk["deltas"] = [openai_delta(f) for f in fragments.feed(event.text)]
                        await ctx.notify(CHUNK_METHOD, chunk)
                else:
                    final = event
                    if parsed.stream and fragments is not None:
                        held = [openai_delta(f) for f in fragments.feed("", final=event.content)]
                        if held:
                            await ctx.notify(CHUNK_METHOD, {"id": ctx.id, "request_id": event.request_id, "content": "",
                                                            "tokens": [], "pieces": [], "drafters": [], "deltas": held})
        finally:
            if owned is not None:
                owned.pop(handle.id, None)
                self._clients.pop(handle.id, None)
            if final is None:
                # Disconnect, shutdown or a failed write: give the slot back now, not at n_predict.
                handle.cancel()
        if final is None:
            raise RpcError(ENGINE_ERROR, "engine ended the request without a final result")
        result = final_result(final, return_tokens=parsed.return_tokens)
        if final.probs is not None and not parsed.stream:
            tokenizer = self.engine.tokenizer
            result["completion_probabilities"] = token_probs_json.native(
                tokenizer, token_probs_json.answer_probs(tokenizer, final) or [])
        if final.stop_type == "error":
            raise self._spec_rejection(parsed, final) or RpcError(ENGINE_ERROR, final.error or "generation failed",
                                                                  result)
        return result

    def _spec_rejection(self, parsed: rp.ParsedCompletion, final: FinalEvent) -> RpcError | None:
        """A request's own `speculative` settings that the engine refused before running (the engine
        says so with `rejected_spec`): a drafter this server cannot create (draft-simple without
        -md), or rates that do not fit. That is the caller's parameter, not an engine failure."""
        spec = parsed.request.spec
        if spec is None or not final.rejected_spec:
            return None
        if spec.types != self.engine.config.spec.types:
            return invalid_params(f"'speculative.type': {', '.join(spec.types)} cannot run on this server: "
                                  f"{final.error}")
        return invalid_params(f"'speculative': these settings cannot run on this server: {final.error}")

    # -- tokenizer ------------------------------------------------------------------------

    async def tokenize(self, params: Any, ctx: CallContext) -> dict[str, Any]:
        obj = rp.as_object(params, "tokenize")
        rp.reject_unknown(obj, {"content", "add_special", "parse_special", "with_pieces"}, "tokenize")
        content = obj.get("content")
        if not isinstance(content, str):
            raise invalid_params("'content' must be a string", "content")
        check_content(content)
        with_pieces = rp.get_bool(obj, "with_pieces", False)
        ids = await self._encode(content, add_special=rp.get_bool(obj, "add_special", False),
                                 parse_special=rp.get_bool(obj, "parse_special", True), prompt=False)
        if not with_pieces:
            return {"tokens": ids}
        check_pieces(len(ids))
        tok = self.engine.tokenizer

        if len(ids) <= _THREAD_TOKENIZE_CHARS:
            return {"tokens": [{"id": t, "piece": tok.decode([t])} for t in ids]}

        def encoded() -> EncodedResult:
            # piece by piece into JSON: a dict per token would hold ~10x the reply's bytes until sent
            parts = [b'{"tokens":[']
            for i, t in enumerate(ids):
                parts.append(b'%s{"id":%d,"piece":%s}' % (b"," if i else b"", t, dumps(tok.decode([t]))))
            parts.append(b"]}")
            return EncodedResult(b"".join(parts))

        # in a worker thread: a decode per token is seconds of CPU for a long text
        return await anyio.to_thread.run_sync(encoded, limiter=tokenize_limiter(len(ids)))

    async def detokenize(self, params: Any, ctx: CallContext) -> dict[str, Any]:
        obj = rp.as_object(params, "detokenize")
        rp.reject_unknown(obj, {"tokens"}, "detokenize")
        tokens = obj.get("tokens")
        ids = await self._off_loop_if_long(tokens, rp.get_token_list, tokens, "tokens", self.engine.tokenizer.n_vocab)
        return {"content": self.engine.tokenizer.decode(ids)}

    # -- introspection and control ----------------------------------------------------------

    async def stats(self, params: Any, ctx: CallContext) -> dict[str, Any]:
        rp.reject_unknown(rp.as_object(params, "stats"), set(), "stats")
        out = dict(self.engine.stats())
        out["slots"] = self._visible_slots(ctx)
        out["server"] = self._server_state()
        return out

    async def slots(self, params: Any, ctx: CallContext) -> list[dict[str, Any]]:
        """Slot states; a request id is shown only to the connection that started the request."""
        rp.reject_unknown(rp.as_object(params, "slots"), set(), "slots")
        return self._visible_slots(ctx)

    def _visible_slots(self, ctx: CallContext) -> list[dict[str, Any]]:
        owned = ctx.connection.owned_requests if ctx.connection is not None else None
        out = []
        for slot in self.engine.slots():
            slot = dict(slot)
            rid = slot.get("request_id")
            if rid is not None and owned is not None:
                mine = rid in owned
                peer = self._clients.get(rid)
                slot["request_id"] = rid if mine else None
                slot["owner"] = "this connection" if mine else "another client"
                if peer is not None:
                    slot["client"] = {"pid": peer.pid, "uid": peer.uid} if mine else {"uid": peer.uid}
            out.append(slot)
        return out

    async def health(self, params: Any, ctx: CallContext) -> dict[str, Any]:
        rp.reject_unknown(rp.as_object(params, "health"), set(), "health")
        return {**self.engine.health(), **self._server_state()}

    async def props(self, params: Any, ctx: CallContext) -> dict[str, Any]:
        rp.reject_unknown(rp.as_object(params, "props"), set(), "props")
        d = self.defaults
        settings = {"n_predict": d.n_predict, **{f: getattr(d.sampling, f) for f in rp.SAMPLING_FIELDS}}
        return {**self.engine.props(), "default_generation_settings": settings, "server": self._server_state()}

    async def cancel(self, params: Any, ctx: CallContext) -> dict[str, Any]:
        """By JSON-RPC `id` or by engine `request_id`, of a request this connection started: another
        client's request answers {cancelled: false}, exactly as an unknown id does."""
        obj = rp.as_object(params, "cancel")
        rp.reject_unknown(obj, {"id", "request_id"}, "cancel")
        if ("id" in obj) == ("request_id" in obj):
            raise invalid_params("cancel: give exactly one of 'id' (JSON-RPC id) or 'request_id' (engine id)", "id")
        if "request_id" in obj:
            rid = obj["request_id"]
            if not isinstance(rid, str):
                raise invalid_params("'request_id' must be a string", "request_id")
            if ctx.connection is not None and rid not in ctx.connection.owned_requests:
                return {"cancelled": False}
            return {"cancelled": self.engine.cancel(rid)}
        if ctx.connection is None:
            raise invalid_params("'id' cancels only work over a connection; use 'request_id'", "id")
        rid = obj["id"]
        if isinstance(rid, bool) or not isinstance(rid, str | int | float):  # what a JSON-RPC id can be
            raise invalid_params("'id' must be a string or a number (the JSON-RPC id of your request)", "id")
        return {"cancelled": ctx.connection.cancel(rid)}


def chunk_params(rpc_id: Any, event: PieceEvent, tokenizer: Any) -> dict[str, Any]:
    """`drafters[i]` proposed `tokens[i]` (null: the target's own token). `pieces[i]` is that token's
    text on its own; the pieces spell `content` except where the engine held text back (a possible
    stop-string prefix, a UTF-8 character split across tokens), which is what clients colour by."""
    return {
        "id": rpc_id,
        "request_id": event.request_id,
        "content": event.text,
        "tokens": list(event.tokens),
        "pieces": [tokenizer.decode([t]) for t in event.tokens],
        "drafters": list(event.drafters),
        **({} if event.probs is None else {"completion_probabilities": token_probs_json.native(tokenizer, event.probs)}),
    }


def final_result(final: FinalEvent, *, return_tokens: bool) -> dict[str, Any]:
    result: dict[str, Any] = {
        "request_id": final.request_id,
        "content": final.content,
        "stop": True,
        "stop_type": final.stop_type,
        "stopping_word": final.stopping_word,
        "tokens_predicted": len(final.tokens),
        "tokens_evaluated": final.tokens_evaluated,
        "timings": dict(final.timings),
    }
    if return_tokens:
        result["tokens"] = list(final.tokens)
    if final.error:
        result["error"] = final.error
    return result
