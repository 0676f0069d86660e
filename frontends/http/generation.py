"""One generation over HTTP: prompt -> engine request -> events, with the client watched.

Shared by llama-server's /completion and the OpenAI endpoints; they differ only in how they shape
what comes out. A client that disconnects, or stops reading a stream for `write_timeout` seconds,
has its request cancelled at once, so its slot is free for the next request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from spekula.core.engine.engine import EMBEDDINGS_ONLY
from spekula.core.events import Event, FinalEvent
from spekula.frontends.http import prompts as http_prompts
from spekula.frontends.http.errors import HttpError, anthropic_path, from_rpc
from spekula.frontends.http.fields import HttpOptions
from spekula.frontends.rpc.methods import MAX_CHARS_PER_TOKEN
from spekula.frontends.rpc.protocol import RpcError
from spekula.frontends.schema import completion as rp
from spekula.frontends.schema.tokenize_limits import tokenize_limiter

if TYPE_CHECKING:
    from spekula.core.params import CompletionRequest
    from spekula.frontends.http.serving_engine import RequestStream, ServingEngine

_THREAD_TOKENIZE_CHARS = 16_384
log = logging.getLogger("spekula.http")


@dataclass(slots=True)
class Generation:
    request: CompletionRequest
    options: HttpOptions
    prompt_text: str | None  # the prompt as text, when it was given (or rendered) as text


class GenerationService:
    def __init__(self, engine: ServingEngine, defaults: rp.ServerDefaults, write_timeout: float) -> None:
        self.engine = engine
        self.defaults = defaults
        self.write_timeout = write_timeout

    async def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True,
                     limit: bool = True) -> list[int]:
        """Token ids; long texts off the event loop. A text that cannot fit a slot is refused
        before tokenizing (at most MAX_CHARS_PER_TOKEN characters per context position)."""
        tok, n_ctx = self.engine.tokenizer, self.engine.config.n_ctx
        if limit and len(text) > MAX_CHARS_PER_TOKEN * n_ctx:
            raise HttpError(f"the prompt has {len(text)} characters and cannot fit a context of {n_ctx} tokens",
                            "exceed_context_size_error", extra={"n_ctx": n_ctx})
        if len(text) > _THREAD_TOKENIZE_CHARS:
            return await anyio.to_thread.run_sync(
                lambda: tok.encode(text, add_special=add_special, parse_special=parse_special),
                limiter=tokenize_limiter(len(text)))
        return tok.encode(text, add_special=add_special, parse_special=parse_special)

    async def prompt_tokens(self, value: Any) -> tuple[list[int], str | None]:
        return await http_prompts.prompt_tokens(value, self.encode, self.engine.tokenizer.n_vocab)

    async def check(self, parsed: rp.ParsedCompletion) -> None:
        """A bad grammar or schema is the caller's 400, found before anything is queued."""
        try:
            await rp.check_grammar(parsed, self.engine)
        except RpcError as exc:
            raise from_rpc(exc) from None

    def build(self, params: dict[str, Any], prompt: list[int], options: HttpOptions,
              prompt_text: str | None) -> tuple[Generation, rp.ParsedCompletion]:
        cfg = self.engine.config
        if cfg.embeddings_only:
            raise HttpError(EMBEDDINGS_ONLY, "not_supported_error")
        try:
            parsed = rp.parse_completion(params, prompt, defaults=self.defaults, spec_base=cfg.spec, n_ctx=cfg.n_ctx,
                                         n_slots=cfg.n_slots, tokenizer=self.engine.tokenizer)
        except RpcError as exc:
            raise from_rpc(exc) from None
        # Both only change what a stream carries, as in llama-server.
        parsed.request.return_progress = options.return_progress and parsed.stream
        parsed.request.timings_per_token = options.timings_per_token and parsed.stream
        if options.logprobs is not None:  # OpenAI's logprobs: the token's own, plus this many alternatives
            parsed.request.token_probs = True
            parsed.request.n_probs = max(parsed.request.n_probs, options.logprobs)
        return Generation(parsed.request, options, prompt_text), parsed

    async def run(self, gen: Generation, request: Request) -> FinalEvent:
        return (await self.run_all([gen], request))[0]

    async def run_all(self, gens: list[Generation], request: Request) -> list[FinalEvent]:
        """Generate without streaming, all at once; the client's disconnect cancels every one."""
        handles = [self.engine.submit(g.request, session=g.options.user) for g in gens]
        finals: list[FinalEvent | None] = [None] * len(handles)

        def cancel_all() -> None:
            for h in handles:
                h.cancel()

        async def one(i: int) -> None:
            finals[i] = await handles[i].result()

        try:
            async with anyio.create_task_group() as tg:
                watch = anyio.CancelScope()

                async def watcher() -> None:
                    with watch:
                        await cancel_on_disconnect(request.receive, cancel_all)

                tg.start_soon(watcher)
                async with anyio.create_task_group() as work:
                    for i in range(len(handles)):
                        work.start_soon(one, i)
                watch.cancel()
        finally:
            if any(f is None for f in finals):
                cancel_all()
        return [self.checked(g, f) for g, f in zip(gens, finals, strict=True) if f is not None]

    def checked(self, gen: Generation, final: FinalEvent) -> FinalEvent:
        if final.stop_type == "error":
            if final.rejected_spec:
                raise HttpError(f"'speculative': these settings cannot run on this server: {final.error}")
            if final.error and final.error.startswith("id_slot"):
                raise HttpError(final.error)
            raise HttpError(final.error or "generation failed", "server_error")
        return final

    def stream(self, gen: Generation, shape: Callable[[Event], list[Any]],
               *, done_marker: bool) -> EventStream:
        """Server-sent events: `shape` turns each engine event into the JSON objects to send."""
        return EventStream(self, gen, shape, done_marker)


async def cancel_on_disconnect(receive: Receive, cancel: Callable[[], None]) -> None:
    """Call `cancel` when the client goes away (the request's body, if any, was read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            cancel()
            return


# One encoder for every event: json.dumps with these options would build a new one per call.
_SSE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return b"data: " + _SSE_JSON.encode(obj).encode() + b"\n\n"


def typed_sse(obj: dict[str, Any]) -> bytes:
    """An event with an `event:` line naming its `type` (Anthropic's and the Responses API's streams)."""
    return f"event: {obj['type']}\n".encode() + sse(obj)


class EventStream:
    """An ASGI response streaming one request's events as `data: {json}` lines.

    Written out rather than Starlette's StreamingResponse so that a send the client does not take
    within `write_timeout` ends the request (a client that stops reading would otherwise hold its
    slot until n_predict), and so the request is submitted only once the response starts.

    The timeout is kept by one watchdog task per stream rather than a cancel scope around each send:
    a scope per token cost about a fifth of the event loop's work for a streamed token, and the loop's
    time is taken from the cores the forward runs on.
    """

    def __init__(self, service: GenerationService, gen: Generation,
                 shape: Callable[[Event], list[Any]], done_marker: bool) -> None:
        self.service, self.gen, self.shape, self.done_marker = service, gen, shape, done_marker
        self._send_since: float | None = None  # when the send now waiting on the client began

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handle = self.service.engine.submit(self.gen.request, session=self.gen.options.user)
        finished = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_on_disconnect, receive, handle.cancel)
                tg.start_soon(self._watch_sends, tg.cancel_scope)
                await self._send(send, {"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no")]})
                async for event in self._events(handle, scope.get("path", "")):
                    await self._send(send, {"type": "http.response.body", "body": event, "more_body": True})
                await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
                finished = True
                tg.cancel_scope.cancel()
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the client went away: nothing more can be said to it
        finally:
            if not finished:
                handle.cancel()

    async def _send(self, send: Send, message: dict[str, Any]) -> None:
        self._send_since = anyio.current_time()
        await send(message)
        self._send_since = None

    async def _watch_sends(self, stream: anyio.CancelScope) -> None:
        """End the stream when one send has waited `write_timeout` seconds: a send that begins while
        this sleeps is seen within half the timeout and then timed from its own start."""
        timeout = self.service.write_timeout
        while True:
            since, now = self._send_since, anyio.current_time()
            if since is None:
                await anyio.sleep(timeout / 2)
            elif now - since >= timeout:
                stream.cancel()  # the client stopped reading: nothing more can be said to it
                return
            else:
                await anyio.sleep(since + timeout - now)

    async def _events(self, handle: RequestStream, path: str) -> AsyncIterator[bytes]:
        """The stream's events; a failure once the stream has begun ends it with an error event in the
        API's shape (the status line has gone out already), not with a broken connection."""
        async for event in handle:
            try:
                if isinstance(event, FinalEvent) and event.stop_type == "error":
                    self.service.checked(self.gen, event)
                framed = [obj if isinstance(obj, bytes) else sse(obj) for obj in self.shape(event)]
            except HttpError as exc:
                yield error_event(exc, path)
                return
            except Exception:  # noqa: BLE001 - the stream's error boundary: logged, and told to the client
                log.exception("internal error in the stream of %s", path)
                yield error_event(HttpError("internal server error", "server_error"), path)
                return
            for data in framed:  # bytes: an event already framed
                yield data
        if self.done_marker:
            yield b"data: [DONE]\n\n"


def error_event(exc: HttpError, path: str) -> bytes:
    """An error as a stream event: Anthropic's streams name it (`event: error`), the others send the
    error object as data, as llama-server does."""
    return typed_sse(exc.body(path)) if anthropic_path(path) else sse(exc.body(path))
