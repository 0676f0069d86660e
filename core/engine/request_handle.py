"""A request's event stream: the engine side (Outbox) and the caller side (RequestHandle).

Each request gets a bounded memory-object stream. The scheduler must never wait on one slow reader
(that would stall every other slot), so the Outbox sends without blocking and, when the buffer is
full, queues the overflow and lets one drainer task in the engine's task group deliver it in order.

A caller that only wants the outcome (`RequestHandle.result()`) says so, and the engine then sends it
the final event alone: delivering a piece to the event loop costs about 0.2 ms of the loop thread's
time per token, which competes with the forward for the machine's cores and slowed decoding by 3-4 %
for callers that threw the pieces away.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from spekula.core.events import Event, FinalEvent, PieceEvent, ProgressEvent

if TYPE_CHECKING:
    from spekula.core.params import CompletionRequest

STREAM_BUFFER = 64


class Outbox:
    def __init__(self, send: MemoryObjectSendStream[Event], on_reader_gone: Callable[[], None]) -> None:
        self._send = send
        self._backlog: deque[Event] = deque()
        self._draining = False
        self._closing = False
        self._on_reader_gone = on_reader_gone
        self.reader_gone = False
        # False once the caller asked for the final event only: pieces and progress are then not sent
        # (the engine's worker thread reads this to skip handing pieces to the loop at all).
        self.wants_pieces = True

    def put(self, event: Event, tg: TaskGroup | None) -> None:
        if self.put_now(event):
            return
        self._backlog.append(event)
        if not self._draining and tg is not None:
            self._draining = True
            tg.start_soon(self._drain)

    def put_now(self, event: Event) -> bool:
        """Deliver without waiting and without a task group if nothing is queued and the stream has
        room; False (nothing done) when the caller must go through `put`. An event this outbox drops
        (its reader is gone, or wants the final event only) counts as delivered."""
        if self.reader_gone or (not self.wants_pieces and isinstance(event, PieceEvent | ProgressEvent)):
            return True
        if self._backlog or self._draining:
            return False
        try:
            self._send.send_nowait(event)
        except anyio.WouldBlock:
            return False
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._gone()
        return True

    def close(self, tg: TaskGroup | None = None) -> None:
        """Close once every queued event is delivered (or right away if nothing is queued).

        Without a task group (the engine is stopping) an undeliverable backlog is dropped so the
        reader sees the end of the stream instead of waiting forever."""
        self._closing = True
        if self._backlog and not self._draining and tg is None:
            self._backlog.clear()
        if not self._backlog and not self._draining:
            self._send.close()

    def _gone(self) -> None:
        self.reader_gone = True
        self._backlog.clear()
        self._send.close()
        self._on_reader_gone()

    async def _drain(self) -> None:
        try:
            while self._backlog:
                await self._send.send(self._backlog[0])
                self._backlog.popleft()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._gone()
        finally:
            self._draining = False
            if self._closing and not self.reader_gone:
                self._send.close()


class RequestHandle:
    """Async-iterable of the request's events; iteration ends after its FinalEvent."""

    def __init__(self, request: CompletionRequest, receive: MemoryObjectReceiveStream[Event],
                 cancel: Callable[[str], bool], outbox: Outbox | None = None) -> None:
        self.id = request.id
        self.request = request
        self._receive = receive
        self._cancel = cancel
        self._outbox = outbox
        self.final: FinalEvent | None = None

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        if self.final is not None:
            return
        async with self._receive:
            async for event in self._receive:
                yield event
                if isinstance(event, FinalEvent):
                    self.final = event
                    return

    def final_only(self) -> None:
        """From now on the engine sends this request's final event alone (no pieces, no progress)."""
        if self._outbox is not None:
            self._outbox.wants_pieces = False

    async def result(self) -> FinalEvent:
        """Drain the stream and return the final event (pieces not yet sent are no longer sent)."""
        self.final_only()
        async for _ in self:
            pass
        if self.final is None:  # the engine stopped without finishing this request
            self.final = FinalEvent(request_id=self.id, content="", tokens=[], stop_type="error",
                                    error="engine stopped before the request finished")
        return self.final

    def cancel(self) -> None:
        self._cancel(self.id)


def open_request(request: CompletionRequest, cancel: Callable[[str], bool],
                 on_reader_gone: Callable[[], None]) -> tuple[RequestHandle, Outbox]:
    send, receive = anyio.create_memory_object_stream[Event](STREAM_BUFFER)
    outbox = Outbox(send, on_reader_gone)
    return RequestHandle(request, receive, cancel, outbox), outbox
