"""Run the HTTP API (uvicorn) and, optionally, the Unix-socket JSON-RPC server over one engine.

The port is bound before the model loads, so a client polling /health sees 503 `Loading model`
and then 200, as with llama-server. SIGTERM/SIGINT stop both servers: uvicorn lets open requests
finish for `drain_timeout` seconds, the socket server drains its own; a second signal stops at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import anyio
import uvicorn

from spekula.core.errors import ConfigError
from spekula.frontends.http.app import build_app
from spekula.frontends.http.generation import GenerationService
from spekula.frontends.http.guarded_protocol import DEFAULT_HEADER_TIMEOUT, guarded_protocol
from spekula.frontends.http.metrics import render as render_metrics
from spekula.frontends.http.state import HttpState
from spekula.frontends.loop_errors import quiet_late_socket_wakeups
from spekula.frontends.rpc.dispatch import Handler
from spekula.frontends.rpc.server import DEFAULT_MAX_CONNECTIONS, RpcServer, ServerConfig
from spekula.frontends.schema import completion as rp

if TYPE_CHECKING:
    from spekula.core.engine.engine import Engine

log = logging.getLogger("spekula.http")


@dataclass
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    drain_timeout: float = 30.0
    timeout_keep_alive: int = 5
    # Connections held at once; more are answered 503 and closed (None: no limit). The same default as
    # the socket's, so idle clients cannot take every file descriptor.
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # a request head must arrive within this (slowloris)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: this module owns shutdown for both servers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so that a busy port fails before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on http://{host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(load: Callable[[], Engine], state: HttpState, http: HttpConfig, *, defaults: rp.ServerDefaults,
                rpc_config: ServerConfig | None = None,
                rpc_methods: Callable[[Engine, RpcServer], Mapping[str, Handler]] | None = None,
                handle_signals: bool = True, on_listening: Callable[[str], None] | None = None) -> None:
    """Bind, load the model (in a thread: /health answers 503 meanwhile), then serve until a signal."""
    quiet_late_socket_wakeups()
    sock = bind(http.host, http.port)
    host, port = sock.getsockname()[:2]
    protocol = guarded_protocol(header_timeout=http.header_timeout, max_connections=http.max_connections)
    config = uvicorn.Config(build_app(state), log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=http.timeout_keep_alive,
                            timeout_graceful_shutdown=max(1, int(http.drain_timeout)), ws="none",
                            server_header=False,
                            # h11 pinned, not "auto": with uvicorn[standard] installed (the Ray extra brings it)
                            # auto picks httptools, which sends header names lower-cased where llama-server's
                            # clients and tests expect its Title-Case, and uvloop, which no measurement here used.
                            # Guarded: a header timeout and a connection cap (guarded_protocol.py).
                            http=protocol, loop="asyncio")
    server = _Uvicorn(config)
    url = f"http://{host}:{port}"
    http_done = anyio.Event()
    stop = anyio.Event()

    async def run_http() -> None:
        try:
            await server.serve([sock])
        finally:
            http_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_http)
        if handle_signals:
            tg.start_soon(_watch_signals, stop, server, tg.cancel_scope, state)
        while not server.started and not http_done.is_set():
            await anyio.sleep(0.01)
        print(f"spekula: HTTP server listening on {url}", file=sys.stderr, flush=True)
        if on_listening is not None:
            on_listening(url)
        engine = await anyio.to_thread.run_sync(load, abandon_on_cancel=True)
        async with anyio.create_task_group() as engine_tg:
            await engine_tg.start(engine.run)
            state.attach(engine, GenerationService(engine, defaults, state.write_timeout))
            state.metrics_render = partial(render_metrics, engine)
            rpc: RpcServer | None = None
            if rpc_config is not None and rpc_methods is not None:
                methods = rpc_methods
                rpc = RpcServer(engine, rpc_config, lambda srv: methods(engine, srv))
                await engine_tg.start(partial(rpc.serve, run_engine=False))
            log.info("serving on %s (%d slot(s))", url, engine.config.n_slots)
            await stop.wait()
            if rpc is not None:
                rpc.shutdown()
            server.should_exit = True
            await http_done.wait()  # uvicorn lets open requests finish, at most drain_timeout
            engine_tg.cancel_scope.cancel()
        tg.cancel_scope.cancel()


async def _watch_signals(stop: anyio.Event, server: uvicorn.Server, scope: anyio.CancelScope,
                         state: HttpState) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if stop.is_set() or state.engine is None:  # a second signal, or nothing loaded to drain
                log.warning("second signal: stopping without waiting for open requests")
                server.force_exit = True
                scope.cancel()
                return
            log.info("received %s: shutting down", signal.Signals(signum).name)
            stop.set()
            server.should_exit = True
