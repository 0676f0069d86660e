"""The HTTP event stream's write timeout, on an ASGI send that the test controls: a client that stops
reading is cut off after `write_timeout`, one that reads slowly but steadily is not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from spekula.core.events import FinalEvent, PieceEvent
from spekula.frontends.http.fields import HttpOptions
from spekula.frontends.http.generation import EventStream, Generation


class _Handle:
    def __init__(self, n_pieces: int) -> None:
        self.n_pieces, self.cancelled = n_pieces, False

    async def _events(self) -> AsyncIterator[Any]:
        for i in range(self.n_pieces):
            await anyio.sleep(0.001)
            yield PieceEvent(request_id="r", tokens=[i], text=f"t{i}", drafters=[None], slot=0)
        yield FinalEvent(request_id="r", content="", tokens=list(range(self.n_pieces)), stop_type="limit")

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._events()

    def cancel(self) -> None:
        self.cancelled = True


class _Engine:
    def __init__(self, handle: _Handle) -> None:
        self.handle = handle

    def submit(self, request: object, session: object = None) -> _Handle:
        return self.handle


class _Service:
    def __init__(self, handle: _Handle, write_timeout: float) -> None:
        self.engine, self.write_timeout = _Engine(handle), write_timeout

    def checked(self, gen: object, final: FinalEvent) -> FinalEvent:
        return final


def _stream(handle: _Handle, write_timeout: float) -> EventStream:
    gen = Generation(request=None, options=HttpOptions(), prompt_text=None)  # type: ignore[arg-type]
    return EventStream(_Service(handle, write_timeout), gen,  # type: ignore[arg-type]
                       lambda ev: [{"n": len(getattr(ev, "tokens", []))}], done_marker=True)


async def _never_disconnects() -> dict[str, Any]:
    await anyio.sleep_forever()
    raise AssertionError


@pytest.mark.anyio
async def test_a_client_that_stops_reading_is_cut_off_after_the_write_timeout() -> None:
    handle, bodies = _Handle(1000), []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message["body"])
            if len(bodies) == 3:
                await anyio.sleep_forever()  # the client's window is full and it never reads again

    t0 = time.monotonic()
    with anyio.fail_after(10):
        await _stream(handle, 0.3)({}, _never_disconnects, send)
    waited = time.monotonic() - t0
    assert handle.cancelled and len(bodies) == 3
    assert 0.25 < waited < 2.0, waited


@pytest.mark.anyio
async def test_a_slow_but_steady_reader_gets_the_whole_stream() -> None:
    handle, bodies = _Handle(12), []

    async def send(message: dict[str, Any]) -> None:
        await anyio.sleep(0.05)  # every send takes a while, all of them together far more than the timeout
        if message["type"] == "http.response.body":
            bodies.append(message["body"])

    with anyio.fail_after(10):
        await _stream(handle, 0.2)({}, _never_disconnects, send)
    assert not handle.cancelled
    assert bodies[-2:] == [b"data: [DONE]\n\n", b""] and len(bodies) == 12 + 1 + 2
