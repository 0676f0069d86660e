"""Quieting two asyncio errors that clients can provoke in the servers, as one line each.

anyio's socket streams wait for a socket to become readable or writable by registering the wait's
future's `set_result` with the selector and removing that registration in a done callback. When the
wait is cancelled (a client that stopped reading hits the write timeout, or went away) and the
socket becomes ready before the done callback has run, the selector calls `set_result` on the
cancelled future; asyncio logs that InvalidStateError with a traceback. Nothing is lost (the wait
had already ended), so the servers log it as one debug line. Running out of descriptors while
accepting is the other (see _OUT_OF_RESOURCES); every other loop error goes to asyncio's own
handler as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("spekula.server")


# asyncio's own words when accept() fails for want of descriptors or memory: it stops accepting on that
# socket for a second and tries again (what the socket server does itself), and logs a traceback. The
# pause is right; one warning line says it.
_OUT_OF_RESOURCES = "socket.accept() out of system resource"


def _is_late_wakeup(context: dict[str, Any]) -> bool:
    exc = context.get("exception")
    handle = context.get("handle")
    callback = getattr(handle, "_callback", None)
    future = getattr(callback, "__self__", None)
    return (isinstance(exc, asyncio.InvalidStateError) and isinstance(future, asyncio.Future)
            and getattr(callback, "__name__", "") == "set_result" and future.done())


def _handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    if _is_late_wakeup(context):
        log.debug("a socket wake-up arrived for a wait that had already ended: ignored")
        return
    if context.get("message") == _OUT_OF_RESOURCES:
        exc = context.get("exception")
        log.warning("accept paused 1 s: %s", getattr(exc, "strerror", None) or exc)
        return
    loop.default_exception_handler(context)


def quiet_late_socket_wakeups() -> None:
    """Install the handler on the running asyncio loop (nothing on other event loops)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    if loop.get_exception_handler() is None:
        loop.set_exception_handler(_handler)
