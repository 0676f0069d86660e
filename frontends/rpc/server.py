"""The Unix-socket JSON-RPC server: socket file lifecycle, accept loop, graceful shutdown.

Socket file rules: created 0600 (umask held around bind, then chmod), present only once it listens, a
stale file left by a dead server is replaced, a live server's socket or a non-socket file is never
touched. SIGTERM/SIGINT stop accepting, let in-flight requests finish (bounded by `drain_timeout`),
then remove the file. A second signal during the drain stops at once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import select
import signal
import socket
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup

from spekula.core.errors import ConfigError, SpekulaError
from spekula.frontends.loop_errors import quiet_late_socket_wakeups
from spekula.frontends.rpc import protocol as p
from spekula.frontends.rpc.dispatch import DEFAULT_MAX_PENDING, Handler, RequestTracker, RpcConnection
from spekula.frontends.rpc.framing import (
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_WRITE_TIMEOUT,
    LineReader,
    LineWriter,
)
from spekula.frontends.rpc.socket_identity import (
    check_private_dir,
    default_socket_dir,
    peer_credentials,
)

if TYPE_CHECKING:
    from spekula.core.engine.engine import Engine

log = logging.getLogger("spekula.server")
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


class SocketInUseError(SpekulaError):
    """Another process serves on the requested socket path, or the path is not ours to replace."""


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
    else:
        peer = peer_credentials(probe)
    finally:
        probe.close()
    who = f" (pid {peer.pid}, uid {peer.uid})" if peer is not None else ""
    raise SocketInUseError(f"a server is already listening on {path}{who}; stop it or choose another --socket")


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
    """Everything that can be checked about a socket path before binding it. The default location's
    directory is created private (0700) and must stay so."""
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ConfigError(f"socket path is longer than {_SUN_PATH_MAX} bytes (an AF_UNIX limit): {path}")
    parent = os.path.dirname(os.path.abspath(path))
    if parent == os.path.abspath(default_socket_dir()):
        check_private_dir(parent, create=True)
    prepare_socket_path(path)


def _staging_path(path: str) -> str | None:
    """A private name beside `path` to bind and listen on before the socket takes its real name, or None
    when no such name fits in sun_path."""
    parent = os.path.dirname(os.path.abspath(path))
    staging = os.path.join(parent, f".spekula-{os.getpid()}-{secrets.token_hex(4)}.sock")
    return staging if len(os.fsencode(staging)) <= _SUN_PATH_MAX else None


async def create_listener(path: str) -> SocketListener:
    """Listen on `path`. The file appears only once the socket listens (bound and listening under a staging
    name, then hard-linked into place), so a client that waits for the file never sees ECONNREFUSED; the
    link also fails rather than replacing a socket another server created meanwhile."""
    check_socket_path(path)
    staging = _staging_path(path)
    # umask makes the file 0600 from the moment it exists; `mode` re-applies it explicitly.
    try:
        with _umask(0o177):
            listener = await anyio.create_unix_listener(staging or path, mode=0o600)
    except OSError as exc:
        raise SocketInUseError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    if staging is None:
        return listener
    try:
        os.link(staging, path)
    except OSError as exc:
        await listener.aclose()
        if exc.errno == errno.EEXIST:
            raise SocketInUseError(f"{path} appeared while this server was starting; refusing to replace it") from None
        raise SocketInUseError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
    return listener


DEFAULT_MAX_CONNECTIONS = 256
# Accept errors that mean "no resources right now" (descriptors, buffers): pause accepting, keep serving.
_TRANSIENT_ACCEPT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass
class ServerConfig:
    socket_path: str
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    drain_timeout: float = 30.0
    handle_signals: bool = True
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # Request lines one connection may have unanswered; beyond, the server stops reading it.
    max_pending: int = DEFAULT_MAX_PENDING
    # A client that reads nothing for this long while the server has replies for it is disconnected.
    write_timeout: float = DEFAULT_WRITE_TIMEOUT


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

    async def serve(self, *, run_engine: bool = True,
                    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until shut down; `run_engine=False` when the caller runs the engine loop (the HTTP
        server shares it)."""
        path = self.config.socket_path
        quiet_late_socket_wakeups()
        async with anyio.create_task_group() as root:
            if run_engine:
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
        pause = 0.05
        with scope:
            while True:
                try:
                    stream = await listener.accept()
                except (OSError, anyio.BrokenResourceError) as exc:
                    # anyio reports the socket's OSError as the BrokenResourceError's cause
                    cause = exc if isinstance(exc, OSError) else exc.__cause__
                    if not isinstance(cause, OSError):
                        raise
                    if cause.errno not in _TRANSIENT_ACCEPT:
                        log.warning("accept failed (%s); continuing", cause)
                        await anyio.sleep(0.01)
                        continue
                    # Out of descriptors: the waiting client stays queued; try again shortly.
                    log.warning("accept paused %.2f s: %s", pause, cause.strerror or cause)
                    await anyio.sleep(pause)
                    pause = min(pause * 2, 2.0)
                    continue
                pause = 0.05
                if self.n_connections >= self.config.max_connections:
                    conns.start_soon(self._refuse, stream)
                    continue
                conns.start_soon(self._serve_connection, stream)

    async def _refuse(self, stream: SocketStream) -> None:
        """Tell a client over the connection limit why, then close."""
        async with stream:
            err = p.RpcError(p.SERVER_BUSY, f"too many connections (limit {self.config.max_connections}); try again later")
            with anyio.move_on_after(1.0), contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(p.encode(p.error_response(None, err)))
        log.warning("refused a connection: %d open (limit %d)", self.n_connections, self.config.max_connections)

    async def _serve_connection(self, stream: SocketStream) -> None:
        self.n_connections += 1
        raw = stream.extra(SocketAttribute.raw_socket)
        peer = peer_credentials(raw)
        log.info("client connected: pid %s uid %s", peer.pid if peer else "?", peer.uid if peer else "?")
        try:
            async with stream:
                reader = LineReader(stream, self.config.max_line_bytes)
                conn = RpcConnection(reader, LineWriter(stream, write_timeout=self.config.write_timeout), self.methods,
                                     self.tracker, peer_closed=lambda: peer_hung_up(raw), max_pending=self.config.max_pending,
                                     peer=peer)
                await conn.serve()
                if conn.dropped_reason:
                    log.warning("client pid %s disconnected: %s", peer.pid if peer else "?", conn.dropped_reason)
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
