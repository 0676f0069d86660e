"""One JSON-RPC 2.0 connection: read loop, id table, cancel scopes, and the one error boundary.

Every inbound request runs in its own task under its own CancelScope, registered in one id table
so that `cancel` and a disconnect can reach it. Handler exceptions become wire errors only in
`_call` (the error boundary); nothing else in the server formats an error.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup

from spekula.core.errors import ConfigError, ContextOverflowError, SpekulaError
from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.framing import LineReader, LineWriter, OversizedLine

log = logging.getLogger("spekula.server")

REQUEST_CANCELLED = -32800  # the code LSP uses for a request cancelled before it produced a result
DEFAULT_MAX_PENDING = 64


@dataclass(slots=True)
class CallContext:
    """What a handler may use: its id, a way to send notifications, and a cancel hook."""

    id: p.RequestId
    notify: Callable[[str, dict[str, Any]], Awaitable[None]]
    connection: RpcConnection | None = None
    # A handler that can stop gracefully (an engine request) sets this; `cancel` then calls it and the
    # handler still returns its partial result. Without it, cancel tears the handler's scope down.
    on_cancel: Callable[[], None] | None = None


Handler = Callable[[Any, CallContext], Awaitable[Any]]


class RequestTracker:
    """Counts request lines in flight across all connections (until replied) so shutdown can drain them."""

    def __init__(self) -> None:
        self.accepting = True
        self.in_flight = 0
        self._idle = anyio.Event()
        self._idle.set()

    def enter(self) -> None:
        if self.in_flight == 0:
            self._idle = anyio.Event()
        self.in_flight += 1

    def exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


@dataclass(slots=True)
class _InFlight:
    scope: anyio.CancelScope
    ctx: CallContext


def to_rpc_error(exc: Exception) -> p.RpcError:
    """The single mapping from Python exceptions to JSON-RPC errors."""
    if isinstance(exc, p.RpcError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return p.RpcError(p.CONTEXT_OVERFLOW, str(exc))
    if isinstance(exc, ConfigError):
        return p.RpcError(p.INVALID_PARAMS, str(exc))
    if isinstance(exc, SpekulaError):
        return p.RpcError(p.ENGINE_ERROR, str(exc))
    log.exception("internal error in handler")
    return p.RpcError(p.INTERNAL_ERROR, f"internal error: {type(exc).__name__}: {exc}")


@dataclass
class RpcConnection:
    reader: LineReader
    writer: LineWriter
    methods: Mapping[str, Handler]
    tracker: RequestTracker = field(default_factory=RequestTracker)
    # After end-of-input: True when the peer closed entirely; False when it only shut down its
    # write side and still reads (`nc -N`, `socat`). None: cannot tell, so treat it as gone.
    peer_closed: Callable[[], bool] | None = None
    half_close_poll: float = 0.1
    # Unanswered request lines allowed at once: at the limit the connection is not read from until
    # replies go out, so a client that pipelines without reading cannot grow the server.
    max_pending: int = DEFAULT_MAX_PENDING
    peer: Any = None  # PeerCred of the client, when known
    dropped_reason: str = ""
    # Engine request ids this connection started -> their JSON-RPC ids: only these can be cancelled
    # or seen by id from here.
    owned_requests: dict[str, p.RequestId] = field(default_factory=dict)
    _table: dict[p.RequestId, _InFlight] = field(default_factory=dict)
    _tg: TaskGroup | None = None
    _busy: int = 0  # lines of this connection not yet answered
    _room: anyio.Event | None = None  # set when _busy drops below max_pending

    async def serve(self) -> None:
        """Serve until the peer closes; then cancel whatever it still had running.

        A peer that only half-closed (shut down writing, still reading) gets its pending replies;
        a full close, at EOF or at any time while those are pending, cancels them at once."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            while True:
                while self._busy >= self.max_pending:
                    self._room = anyio.Event()
                    await self._room.wait()
                try:
                    line = await self.reader.receive_line()
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    line = None
                if line is None:
                    break
                if isinstance(line, OversizedLine) or line.strip():
                    # Counted from here until its reply is written, so a draining shutdown never
                    # closes the connection between a result and its delivery.
                    self.tracker.enter()
                    self._busy += 1
                    tg.start_soon(self._handle_line, line)
            if self.peer_closed is not None:
                while self._busy and not self.peer_closed():
                    await anyio.sleep(self.half_close_poll)
            # The peer is gone (or has everything it asked for): free its slots now.
            tg.cancel_scope.cancel()

    def cancel(self, rid: p.RequestId) -> bool:
        """Cancel an in-flight request of this connection by its JSON-RPC id."""
        entry = self._table.get(rid)
        if entry is None:
            return False
        if entry.ctx.on_cancel is not None:
            entry.ctx.on_cancel()
        else:
            entry.scope.cancel()
        return True

    def cancel_all(self) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def _send(self, message: Any) -> None:
        try:
            try:
                await self.writer.send(message)
            except (TypeError, ValueError) as exc:  # a handler returned something JSON cannot hold
                if not isinstance(message, dict) or "id" not in message:
                    raise
                err = p.RpcError(p.INTERNAL_ERROR, f"internal error: result is not JSON-serialisable: {exc}")
                await self.writer.send(p.error_response(message["id"], err))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            # A vanished or non-reading peer: stop its requests at once rather than compute unread text.
            self.dropped_reason = self.dropped_reason or (str(exc) or "write failed: the client went away")
            self.cancel_all()

    async def _handle_line(self, line: bytes | OversizedLine) -> None:
        try:
            if isinstance(line, OversizedLine):
                err = p.RpcError(p.INVALID_REQUEST, f"request line exceeds {line.limit} bytes; discarded")
                await self._send(p.error_response(None, err))
                return
            try:
                obj = p.parse_line(line)
            except p.RpcError as err:
                await self._send(p.error_response(None, err))
                return
            if isinstance(obj, list):
                await self._handle_batch(obj)
                return
            reply = await self._handle_one(obj)
            if reply is not None:
                await self._send(reply)
        finally:
            self._busy -= 1
            self.tracker.exit()
            if self._room is not None and self._busy < self.max_pending:
                self._room.set()

    async def _handle_batch(self, items: list[Any]) -> None:
        if not items:
            await self._send(p.error_response(None, p.RpcError(p.INVALID_REQUEST, "invalid request: empty batch")))
            return
        replies: list[dict[str, Any] | None] = [None] * len(items)

        async def run(i: int, item: Any) -> None:
            replies[i] = await self._handle_one(item)

        async with anyio.create_task_group() as tg:
            for i, item in enumerate(items):
                tg.start_soon(run, i, item)
        out = [r for r in replies if r is not None]
        if out:  # a batch of notifications only gets no reply at all (JSON-RPC 2.0 batches)
            await self._send(out)

    async def _handle_one(self, obj: Any) -> dict[str, Any] | None:
        try:
            req = p.validate_request(obj)
        except p.RpcError as err:
            return p.error_response(p.error_id(err), err)
        reply = await self._call(req)
        return None if req.is_notification else reply

    async def _call(self, req: p.Request) -> dict[str, Any]:
        """The error boundary: run one handler and turn whatever happens into a reply."""
        handler = self.methods.get(req.method)
        if handler is None:
            return p.error_response(req.id, p.RpcError(p.METHOD_NOT_FOUND, f"method not found: {req.method!r}"))
        if not self.tracker.accepting:
            return p.error_response(req.id, p.RpcError(p.SHUTTING_DOWN, "server is shutting down"))
        tracked = req.id is not None and not req.is_notification
        if tracked and req.id in self._table:
            return p.error_response(req.id, p.RpcError(p.DUPLICATE_ID, f"request id {req.id!r} is already in flight"))

        async def notify(method: str, params: dict[str, Any]) -> None:
            await self._send(p.notification(method, params))

        ctx = CallContext(id=req.id, notify=notify, connection=self)
        scope = anyio.CancelScope()
        if tracked:
            self._table[req.id] = _InFlight(scope, ctx)
        try:
            with scope:
                result = await handler(req.params, ctx)
                return p.response(req.id, result)
            return p.error_response(req.id, p.RpcError(REQUEST_CANCELLED, "request cancelled"))
        except Exception as exc:  # noqa: BLE001 - this is the error boundary
            return p.error_response(req.id, to_rpc_error(exc))
        finally:
            if tracked:
                self._table.pop(req.id, None)
