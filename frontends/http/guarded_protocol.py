"""uvicorn's h11 protocol with the two guards it lacks against slow or numerous clients, and a JSON answer
to a request it cannot parse (uvicorn's is plain text).

- Headers must arrive within `header_timeout` seconds of the connection opening, or of the previous
  response on a kept-alive connection. h11 has no such timeout, and uvicorn's keep-alive timer is reset
  by every byte, so a client sending a header byte every few seconds (slowloris) held its connection,
  and its descriptor, for ever. The timer is not reset by data: only a complete request head stops it.
- At most `max_connections` connections are held. uvicorn's `limit_concurrency` answers 503 to a request
  over its limit but keeps every accepted connection open, so idle connections could take every file
  descriptor. Over the cap, a new connection is answered 503 (JSON, in llama-server's error shape) at
  once and closed. When descriptors do run out, asyncio stops accepting for a second and tries again
  (frontends/loop_errors.py logs that as one line), as the socket server does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from spekula.frontends.http.errors import HttpError

log = logging.getLogger("spekula.http")
DEFAULT_HEADER_TIMEOUT = 10.0
_REFUSED_LINGER_S = 0.5


def _busy_reply(limit: int) -> bytes:
    body = json.dumps(HttpError(f"too many connections (limit {limit}); try again later", "unavailable_error")
                      .body()).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\nRetry-After: 1\r\n\r\n").encode()
    return head + body


class GuardedH11Protocol(H11Protocol):
    """Set `header_timeout` and `max_connections` on a subclass (`guarded_protocol` makes one)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_connections: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.max_connections
        if limit is not None and len(self.connections) > limit:
            log.warning("refused a connection: %d open (limit %d)", len(self.connections) - 1, limit)
            self._refused = True
            transport.write(_busy_reply(limit))
            # Half-close, then close a moment later: closing a socket with the client's request still
            # unread sends a reset, which can destroy the 503 before the client reads it.
            if transport.can_write_eof():
                transport.write_eof()
            self.loop.call_later(_REFUSED_LINGER_S, transport.close)
            return
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered already; its request is read and dropped
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse: uvicorn answers plain text; the API's clients expect its JSON error."""
        body = json.dumps(HttpError(msg).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event) or b"")
        except h11.LocalProtocolError:
            pass  # a response had begun already: nothing more can be said
        self.transport.close()

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _watch_headers(self) -> None:
        """Arm the header timer while a request head is awaited (once: data does not re-arm it), stop it
        once one has arrived."""
        if self.transport is None or self.transport.is_closing() or not self._waiting_for_headers():
            self._stop_header_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            log.info("closed a connection whose request head did not arrive within %g s", self.header_timeout)
            self.transport.close()


def guarded_protocol(*, header_timeout: float, max_connections: int | None) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's `http` setting, with these limits."""
    return type("SpekulaH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})
