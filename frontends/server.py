"""The Unix-socket JSON-RPC server: socket file lifecycle, accept loop, graceful shutdown.

Socket file rules: created 0600 (umask held around bind, then chmod), a stale file left by a dead
server is replaced, a live server's socket or a non-socket file is never touched. SIGTERM/SIGINT
stop accepting, let in-flight requests finish (bounded by `drain_timeout`), then remove the file.
A second signal during the drain stops at once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup
from spekula.core.errors import ConfigError, SpekulaError

from .rpc_dispatch import Handler, RequestTracker, RpcConnection
from .rpc_framing import DEFAULT_MAX_LINE_BYTES, LineReader, LineWriter

if TYPE_CHECKING:
    from spekula.core.engine import Engine

log = logging.getLogger("spekula.server")
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


class SocketInUseError(SpekulaError):
    """Another process serves on the requested socket path, or the path is not ours to replace."""


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/spekula.sock when the session has one (private to the user), else /tmp."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "spekula.sock")
    return os.path.join(tempfile.gettempdir(), f"spekula-{os.getuid()}.sock")


def prepare_socket_path(path: str) -> None:
    """Remove a stale socket file; refuse a live one or anything that is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise SocketInUseError(f"cannot create socket {path}: directory {parent} does not exist") from None
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUseError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        log.info("removing stale socket %s", path)
        os.unlink(path)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.EAGAIN:  # backlog full: certainly alive
            raise SocketInUseError(f"a server is already listening on {path}") from None
        raise SocketInUseError(f"cannot check socket {path}: {exc}") from None
    finally:
        probe.close()
    raise SocketInUseError(f"a server is already listening on {path}; stop it or choose another --socket")


def peer_hung_up(sock: socket.socket) -> bool:
    """True once the peer closed its end entirely. Linux reports POLLHUP on a Unix stream socket
    only when both directions are shut, so a peer that merely shut down writing reads False."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP)
    try:
        return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in poller.poll(0))
    except OSError:
        return True


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def check_socket_path(path: str) -> None:
    """Everything that can be checked about a socket path before binding it."""
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ConfigError(f"socket path is longer than {_SUN_PATH_MAX} bytes (an AF_UNIX limit): {path}")
    prepare_socket_path(path)


async def create_listener(path: str) -> SocketListener:
    check_socket_path(path)
    # umask makes the file 0600 from the moment it exists; `mode` re-applies it explicitly.
    try:
        with _umask(0o177):
            return await anyio.create_unix_listener(path, mode=0o600)
    except OSError as exc:
        raise SocketInUseError(f"cannot listen on {path}: {exc.strerror or exc}") from None


@dataclass
class ServerConfig:
    socket_path: str
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    drain_timeout: float = 30.0
    handle_signals: bool = True


class RpcServer:
    """Runs the engine loop and serves `methods` on a Unix socket until shut down."""

    def __init__(self, engine: Engine, config: ServerConfig, methods: Callable[[RpcServer], Mapping[str, Handler]]) -> None:
        self.engine = engine
        self.config = config
        self.tracker = RequestTracker()
        self.n_connections = 0
        self.methods = methods(self)
        self._stop = anyio.Event()
        self._inode: int | None = None

    def state(self) -> dict[str, Any]:
        return {
            "socket": self.config.socket_path,
            "connections": self.n_connections,
            "requests_in_flight": self.tracker.in_flight,
            "max_line_bytes": self.config.max_line_bytes,
            "draining": not self.tracker.accepting,
        }

    def shutdown(self) -> None:
        self._stop.set()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        path = self.config.socket_path
        async with anyio.create_task_group() as root:
            await root.start(self.engine.run)
            listener = await create_listener(path)
            self._inode = os.stat(path).st_ino
            try:
                async with anyio.create_task_group() as conns:
                    if self.config.handle_signals:
                        root.start_soon(self._watch_signals, conns)
                    accept_scope = anyio.CancelScope()
                    conns.start_soon(self._accept_loop, listener, conns, accept_scope)
                    log.info("serving on %s (%d slot(s))", path, self.engine.config.n_slots)
                    task_status.started(path)
                    await self._stop.wait()
                    await self._drain(listener, accept_scope, conns)
            finally:
                with anyio.CancelScope(shield=True):
                    await listener.aclose()
                self._remove_socket()
            root.cancel_scope.cancel()  # stops the engine loop and the signal watcher

    async def _drain(self, listener: SocketListener, accept_scope: anyio.CancelScope, conns: TaskGroup) -> None:
        self.tracker.accepting = False
        accept_scope.cancel()
        log.info("draining %d in-flight request(s)", self.tracker.in_flight)
        with anyio.move_on_after(self.config.drain_timeout):
            await self.tracker.wait_idle()
        conns.cancel_scope.cancel()

    async def _accept_loop(self, listener: SocketListener, conns: TaskGroup, scope: anyio.CancelScope) -> None:
        with scope:
            while True:
                stream = await listener.accept()
                conns.start_soon(self._serve_connection, stream)

    async def _serve_connection(self, stream: SocketStream) -> None:
        self.n_connections += 1
        try:
            async with stream:
                reader = LineReader(stream, self.config.max_line_bytes)
                raw = stream.extra(SocketAttribute.raw_socket)
                await RpcConnection(reader, LineWriter(stream), self.methods, self.tracker,
                                    peer_closed=lambda: peer_hung_up(raw)).serve()
        finally:
            self.n_connections -= 1

    async def _watch_signals(self, conns: TaskGroup) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self._stop.is_set():
                    log.warning("second signal: stopping without waiting for in-flight requests")
                    conns.cancel_scope.cancel()
                    return
                log.info("received %s: shutting down", signal.Signals(signum).name)
                self._stop.set()

    def _remove_socket(self) -> None:
        path = self.config.socket_path
        try:
            # Only our own file: a successor may already have bound the same path.
            if self._inode is not None and os.stat(path).st_ino == self._inode:
                os.unlink(path)
        except FileNotFoundError:
            pass
