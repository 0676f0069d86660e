"""The HTTP API as one Starlette application over a running Engine.

Requests pass two gates before any route, as in llama-server: the API key (every path but the
health checks needs `Authorization: Bearer KEY` when keys are set; compared in constant time)
and readiness (503 `Loading model` until the engine exists). Bodies are read with a size cap (413
beyond it) and parsed by the same hardened JSON decoder as the socket (depth and number limits).
Every error leaves as JSON in the API's own shape: llama-server's `{"error": {"code", "message", "type"}}`,
Anthropic's `{"type": "error", "error": {...}}` on its Messages paths, an internal failure included (500).
A body must arrive within the state's `body_timeout` of its headers (408); a client that leaves
mid-upload is one INFO line. After a request that moved more than a megabyte either way, the heap's
free pages go back to the system (frontends/malloc_tuning.py).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from spekula.frontends.http import anthropic, native, openai
from spekula.frontends.http.embeddings import embeddings_native, embeddings_oai, rerank
from spekula.frontends.http.errors import HttpError
from spekula.frontends.http.infill import infill
from spekula.frontends.http.responses import responses
from spekula.frontends.http.slot_files import slot_action
from spekula.frontends.http.state import HttpState
from spekula.frontends.malloc_tuning import TRIM_AFTER_BYTES, release_free_memory

if TYPE_CHECKING:
    from starlette.types import Message

log = logging.getLogger("spekula.http")
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


def _key_ok(header: str, keys: tuple[str, ...]) -> bool:
    given = header.removeprefix("Bearer ").encode()
    ok = False
    for key in keys:  # every key is compared, so the time does not tell which one nearly matched
        ok |= hmac.compare_digest(given, key.encode())
    return ok


class Gates:
    """Pure ASGI middleware: CORS headers, API key, then llama-server's JSON errors for whatever the
    routes raise (HttpError) or fail with (500, logged)."""

    def __init__(self, app: ASGIApp, state: HttpState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        cors = self._cors(headers.get("origin", ""))
        path = scope.get("path", "")
        started = False
        moved = [0]  # body bytes received and sent
        body_done = False
        deadline = anyio.current_time() + self.state.body_timeout

        async def send_with_cors(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                # Header names in their usual case (Starlette lowercases them): HTTP does not care,
                # but clients that copy headers into a plain dict look them up as `Content-Type`.
                headers = [(_title(k), v) for k, v in [*message.get("headers", []), *cors]]
                if self.state.server_header:
                    headers.append((b"Server", b"spekula"))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body":
                moved[0] += len(message.get("body", b""))
            await send(message)

        async def timed_receive() -> Message:
            """The body within its deadline; after it, receive waits as long as the request runs
            (a stream listens for the client's disconnect that way)."""
            nonlocal body_done
            if body_done:
                return await receive()
            with anyio.move_on_after(max(deadline - anyio.current_time(), 0.0)) as waited:
                message = await receive()
            if waited.cancelled_caught:
                log.info("%s %s: the body did not arrive within %g s", scope.get("method"), path,
                         self.state.body_timeout)
                raise HttpError(f"request body not received within {self.state.body_timeout:g} s", "timeout_error")
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            moved[0] += len(message.get("body", b""))
            return message

        try:
            if scope["method"] == "OPTIONS":  # CORS preflight: no key needed, nothing runs
                await self._respond(send_with_cors, Response(status_code=200, headers={
                    "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                    "Access-Control-Allow-Headers": "*"}), scope, receive)
                return
            if self.state.api_keys and path not in PUBLIC_PATHS and not self._static(path):
                given = headers.get("authorization") or headers.get("x-api-key") or ""
                if not _key_ok(given, self.state.api_keys):
                    raise HttpError("Invalid API Key", "authentication_error")
            await self.app(scope, timed_receive, send_with_cors)
        except HttpError as exc:
            if not started:
                await self._respond(send_with_cors, exc.response(path), scope, receive)
        except ClientDisconnect:
            log.info("%s %s: the client went away before its request was read", scope.get("method"), path)
        except Exception:
            log.exception("internal error on %s %s", scope.get("method"), path)
            if not started:
                err = HttpError("internal server error", "server_error")
                await self._respond(send_with_cors, err.response(path), scope, receive)
        finally:
            if moved[0] > TRIM_AFTER_BYTES:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(release_free_memory)

    @staticmethod
    async def _respond(send: Callable[[dict[str, Any]], Awaitable[None]], response: Response, scope: Scope,
                       receive: Receive) -> None:
        await response(scope, receive, send)  # type: ignore[arg-type]

    def _static(self, path: str) -> bool:
        """A static file of --path (llama-server serves its UI assets without a key, too)."""
        root = self.state.static_dir
        if root is None or ".." in path.split("/"):
            return False
        rel = path.lstrip("/") or "index.html"
        return os.path.isfile(os.path.join(root, rel))

    def _cors(self, origin: str) -> list[tuple[bytes, bytes]]:
        """llama-server's rules: `*` reflects any Origin (with credentials), `localhost` only local
        ones, otherwise the listed origins."""
        allowed = self.state.cors_origins
        if allowed == "*":
            value = origin or "*"
        elif allowed == "localhost":
            value = origin if _is_localhost(origin) else ""
        else:
            value = origin if origin in {o.strip() for o in allowed.split(",")} else ""
        if not value:
            return []
        out = [(b"access-control-allow-origin", value.encode("latin-1"))]
        if value != "*":
            out.append((b"access-control-allow-credentials", b"true"))
        return out


def _title(name: bytes) -> bytes:
    return b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))


def _is_localhost(origin: str) -> bool:
    host = origin.split("://", 1)[-1].split("/", 1)[0]
    host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return host in ("localhost", "127.0.0.1", "[::1]")


async def _metrics(request: Request) -> Response:
    state: HttpState = request.app.state.http
    await state.live()
    if not state.metrics or state.metrics_render is None:
        raise HttpError("This server does not support metrics endpoint. Start it with `--metrics`",
                        "not_supported_error")
    return Response(state.metrics_render(), media_type="text/plain; version=0.0.4; charset=utf-8",
                    headers={"Process-Start-Time-Unix": str(int(state.started))})


async def _tools(request: Request) -> Response:
    """Server-side tools (llama-server's --tools) do not exist here; its answer when they are off."""
    return JSONResponse({"error": {"message": "this feature is disabled", "type": "feature_disabled"}},
                        status_code=403)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HttpError)
    return exc.response(request.url.path)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """What Starlette's last-resort handler sends for an unexpected exception (a plain-text 500 without
    this); the exception still reaches Gates, which logs it."""
    return HttpError("internal server error", "server_error").response(request.url.path)


async def _not_found(request: Request, exc: Exception) -> Response:
    return HttpError("File Not Found", "not_found_error").response(request.url.path)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return HttpError(f"method {request.method} is not allowed on {request.url.path}",
                     status=405).response(request.url.path)


class _GetOnly:
    """Static files answer GET/HEAD; any other method on a path no route has is a plain 404
    (StaticFiles would say 405, as if the path existed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD"):
            raise HttpError("File Not Found", "not_found_error")
        await self.app(scope, receive, send)


def build_app(state: HttpState) -> ASGIApp:
    get, post = ["GET"], ["POST"]
    routes = [
        Route("/health", native.health, methods=get), Route("/v1/health", native.health, methods=get),
        Route("/props", native.props, methods=get), Route("/slots", native.slots, methods=get),
        Route("/slots/{id_slot}", slot_action, methods=post),
        Route("/metrics", _metrics, methods=get),
        Route("/completion", native.completion, methods=post), Route("/completions", native.completion, methods=post),
        Route("/tokenize", native.tokenize, methods=post), Route("/detokenize", native.detokenize, methods=post),
        Route("/apply-template", native.apply_template, methods=post), Route("/infill", infill, methods=post),
        Route("/models", openai.models, methods=get), Route("/v1/models", openai.models, methods=get),
        Route("/v1/completions", openai.completions, methods=post),
        Route("/chat/completions", openai.chat_completions, methods=post),
        Route("/v1/chat/completions", openai.chat_completions, methods=post),
        Route("/v1/messages", anthropic.messages, methods=post),
        Route("/v1/responses", responses, methods=post), Route("/responses", responses, methods=post),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=post),
        Route("/chat/completions/input_tokens", openai.input_tokens, methods=post),
        Route("/v1/chat/completions/input_tokens", openai.input_tokens, methods=post),
        Route("/tools", _tools, methods=["GET", "POST"]),
        Route("/embedding", embeddings_native, methods=post), Route("/embeddings", embeddings_native, methods=post),
        Route("/v1/embeddings", embeddings_oai, methods=post),
        *(Route(path, rerank, methods=post) for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")),
    ]
    if state.static_dir is not None:
        # After every API route, so a file can never shadow an endpoint.
        routes.append(Mount("/", app=_GetOnly(StaticFiles(directory=state.static_dir, html=True)), name="static"))
    app = Starlette(routes=routes, exception_handlers={
        HttpError: _http_error, 404: _not_found, 405: _method_not_allowed, Exception: _internal_error})
    app.state.http = state
    return Gates(app, state)
