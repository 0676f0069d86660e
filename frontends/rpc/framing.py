"""Newline-delimited framing over an anyio byte stream.

One JSON value per line. A line longer than `max_bytes` is not an error of the connection: the
reader discards it up to its newline and reports it as `OversizedLine`, so the server can answer
with an error and keep serving the same client.
"""

from __future__ import annotations

from typing import Any

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream
from anyio.streams.buffered import BufferedByteReceiveStream

from spekula.frontends.rpc.protocol import encode

DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
DEFAULT_WRITE_TIMEOUT = 60.0
_DISCARD_CHUNK = 64 * 1024


class OversizedLine:
    """Marker returned instead of a line that exceeded the limit (its bytes are already dropped)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit


class LineReader:
    def __init__(self, stream: ByteReceiveStream, max_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self._buffered = BufferedByteReceiveStream(stream)
        self.max_bytes = max_bytes

    async def receive_line(self) -> bytes | OversizedLine | None:
        """The next line without its newline; None at end of stream (a partial last line is dropped)."""
        try:
            line = await self._buffered.receive_until(b"\n", self.max_bytes)
        except anyio.IncompleteRead:
            return None
        except anyio.DelimiterNotFound:
            if await self._discard_rest_of_line():
                return OversizedLine(self.max_bytes)
            return None
        # receive_until only enforces the limit while it still has to read; a long line that
        # arrived in one chunk is found in the buffer, so check its length here as well.
        return OversizedLine(self.max_bytes) if len(line) > self.max_bytes else line

    async def _discard_rest_of_line(self) -> bool:
        """Drop bytes up to and including the next newline; False if the stream ended first."""
        while True:
            pending = len(self._buffered.buffer)
            try:
                # Drain what is buffered in one piece; read the socket in bounded chunks so a
                # huge line never needs a huge allocation.
                chunk = await self._buffered.receive(pending or _DISCARD_CHUNK)
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                return False
            newline = chunk.find(b"\n")
            if newline >= 0:
                # The buffer is empty here (we took all of it), so re-feeding keeps byte order.
                self._buffered.feed_data(chunk[newline + 1 :])
                return True


class WriteTimeout(anyio.BrokenResourceError):
    """The peer read nothing for `write_timeout` seconds while a frame waited: treated as gone."""


class LineWriter:
    """Serialises whole frames from concurrent tasks onto one stream. A frame that cannot be written
    within `write_timeout` (the client stopped reading) breaks the stream instead of waiting forever."""

    def __init__(self, stream: ByteSendStream, *, write_timeout: float | None = DEFAULT_WRITE_TIMEOUT) -> None:
        self._stream = stream
        self._lock = anyio.Lock()
        self.write_timeout = write_timeout
        self.queued_bytes = 0  # encoded frames waiting for their turn or being written
        self._sent_one: anyio.Event | None = None  # set each time a frame leaves the queue

    async def wait_below(self, limit: int) -> None:
        """Until fewer than `limit` bytes wait to be written (the client reads, or the stream breaks)."""
        while self.queued_bytes >= limit:
            if self._sent_one is None:
                self._sent_one = anyio.Event()
            await self._sent_one.wait()

    async def send(self, message: Any) -> None:
        await self.send_frame(encode(message))

    async def send_frame(self, data: bytes) -> None:
        """One frame already encoded (the caller may then drop the message it came from)."""
        self.queued_bytes += len(data)
        try:
            async with self._lock:
                if self.write_timeout is None:
                    await self._stream.send(data)
                    return
                with anyio.move_on_after(self.write_timeout) as scope:
                    await self._stream.send(data)
                if scope.cancelled_caught:
                    raise WriteTimeout(f"client read nothing for {self.write_timeout:g} s")
        finally:
            self.queued_bytes -= len(data)
            if self._sent_one is not None:
                self._sent_one.set()
                self._sent_one = None
