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
import anyio.to_thread
from anyio.abc import TaskGroup

from spekula.core.errors import ConfigError, ContextOverflowError, SpekulaError
from spekula.frontends.malloc_tuning import TRIM_AFTER_BYTES, release_free_memory
from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.framing import LineReader, LineWriter, OversizedLine
from spekula.frontends.rpc.parse_off_loop import decode_json
from spekula.frontends.schema.unicode_check import lone_surrogate_at, not_unicode_message

log = logging.getLogger("spekula.server")

REQUEST_CANCELLED = -32800  # the code LSP uses for a request cancelled before it produced a result
DEFAULT_MAX_PENDING = 64
# Bytes one connection may have in flight: its unanswered request lines, and its encoded replies that
# wait for the client to read. Past either, the connection is not read from until replies go out, so
# a client that pipelines large calls (a tokenize with pieces answers ~10x its request) and never
# reads holds at most about this much of the server's memory, not DEFAULT_MAX_PENDING replies' worth.
DEFAULT_MAX_PENDING_BYTES = 4 * 1024 * 1024


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
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    peer: Any = None  # PeerCred of the client, when known
    dropped_reason: str = ""
    # Engine request ids this connection started -> their JSON-RPC ids: only these can be cancelled
    # or seen by id from here.
    owned_requests: dict[str, p.RequestId] = field(default_factory=dict)
    _table: dict[p.RequestId, _InFlight] = field(default_factory=dict)
    _tg: TaskGroup | None = None
    _busy: int = 0  # lines of this connection not yet answered
    _busy_bytes: int = 0  # their length
    _room: anyio.Event | None = None  # set whenever a line is answered

    async def serve(self) -> None:
        """Serve until the peer closes; then cancel whatever it still had running.

        A peer that only half-closed (shut down writing, still reading) gets its pending replies;
        a full close, at EOF or at any time while those are pending, cancels them at once."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            while True:
                while self._full():
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
                    self._busy_bytes += line.limit if isinstance(line, OversizedLine) else len(line)
                    tg.start_soon(self._handle_line, line)
            if self.peer_closed is not None:
                while self._busy and not self.peer_closed():
                    await anyio.sleep(self.half_close_poll)
            # The peer is gone (or has everything it asked for): free its slots now.
            tg.cancel_scope.cancel()

    def _full(self) -> bool:
        """Whether to stop reading: too many lines unanswered, or too many bytes of them or of replies
        waiting (always one line at least, or a connection could never be read again)."""
        if self._busy >= self.max_pending:
            return True
        return self._busy > 0 and max(self._busy_bytes, self.writer.queued_bytes) >= self.max_pending_bytes

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
        await self._send_frame(self._frame(message))

    @staticmethod
    def _frame(message: Any) -> bytes:
        try:
            return p.encode(message)
        except (TypeError, ValueError) as exc:  # a handler returned something JSON cannot hold
            if not isinstance(message, dict) or "id" not in message:
                raise
            err = p.RpcError(p.INTERNAL_ERROR, f"internal error: result is not JSON-serialisable: {exc}")
            return p.encode(p.error_response(message["id"], err))

    async def _send_frame(self, frame: bytes) -> None:
        try:
            await self.writer.send_frame(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            # A vanished or non-reading peer: stop its requests at once rather than compute unread text.
            self.dropped_reason = self.dropped_reason or (str(exc) or "write failed: the client went away")
            self.cancel_all()

    async def _handle_line(self, line: bytes | OversizedLine) -> None:
        size = line_size = line.limit if isinstance(line, OversizedLine) else len(line)
        try:
            if isinstance(line, OversizedLine):
                err = p.RpcError(p.INVALID_REQUEST, f"request line exceeds {line.limit} bytes; discarded")
                await self._send(p.error_response(None, err))
                return
            try:
                decoded = await decode_json(line)
            except p.RpcError as err:
                await self._send(p.error_response(None, err))
                return
            del line
            obj, bad_text = decoded.value, decoded.not_unicode_at is not None
            del decoded
            # Replies this client has not read yet hold their bytes: no new work until they shrink.
            await self.writer.wait_below(self.max_pending_bytes)
            if isinstance(obj, list):
                await self._handle_batch(obj, bad_text)
                return
            reply = await self._handle_one(obj, bad_text)
            del obj
            if reply is not None:
                frame = self._frame(reply)
                del reply  # a large result is freed while its frame waits
                size = max(size, len(frame))
                await self._send_frame(frame)
        finally:
            self._busy -= 1
            self._busy_bytes -= line_size
            self.tracker.exit()
            if self._room is not None:
                self._room.set()
            if size > TRIM_AFTER_BYTES:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(release_free_memory)

    async def _handle_batch(self, items: list[Any], bad_text: bool) -> None:
        if not items:
            await self._send(p.error_response(None, p.RpcError(p.INVALID_REQUEST, "invalid request: empty batch")))
            return
        replies: list[dict[str, Any] | None] = [None] * len(items)

        async def run(i: int, item: Any) -> None:
            replies[i] = await self._handle_one(item, bad_text)

        async with anyio.create_task_group() as tg:
            for i, item in enumerate(items):
                tg.start_soon(run, i, item)
        out = [r for r in replies if r is not None]
        if out:  # a batch of notifications only gets no reply at all (JSON-RPC 2.0 batches)
            await self._send(out)

    async def _handle_one(self, obj: Any, bad_text: bool = False) -> dict[str, Any] | None:
        """`bad_text`: the line may hold text that is not Unicode (a lone surrogate); such params are
        refused (-32602, naming the field) before any handler sees them."""
        try:
            req = p.validate_request(obj)
        except p.RpcError as err:
            return p.error_response(p.error_id(err), err)
        where = lone_surrogate_at(req.params, "params") if bad_text and req.params is not None else None
        if where is not None:
            reply: dict[str, Any] | None = p.error_response(req.id, p.RpcError(p.INVALID_PARAMS,
                                                                               not_unicode_message(where)))
        else:
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
