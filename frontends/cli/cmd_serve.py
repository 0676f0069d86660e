"""`spekula serve`: the HTTP API (llama-server and OpenAI endpoints, frontends/http/app.py) with
`--port`, the JSON-RPC 2.0 server on a Unix socket (frontends/rpc/methods.py) with `--socket`, or
both over one engine. Without `--port` the socket is served at its default path, as before."""

from __future__ import annotations

import argparse
from functools import partial
from typing import TYPE_CHECKING

import anyio

from spekula.core.embedding import Pooling
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.rerank_prompt import RerankFormat
from spekula.frontends.cli.options import build_engine
from spekula.frontends.cli.serve_options import add_arguments as add_arguments
from spekula.frontends.cli.serve_options import http_state, server_defaults
from spekula.frontends.logging_setup import configure_logging
from spekula.frontends.malloc_tuning import pin_mmap_threshold
from spekula.frontends.rpc.methods import SpekulaMethods
from spekula.frontends.rpc.server import RpcServer, ServerConfig, check_socket_path
from spekula.frontends.rpc.socket_identity import default_socket_path
from spekula.frontends.schema.completion import ServerDefaults

if TYPE_CHECKING:
    from spekula.core.engine.engine import Engine

HELP = "Serve the HTTP API (--port) and/or the JSON-RPC 2.0 API on a Unix socket (--socket)"
def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose, stdlib=True, log_format=args.log_format, events=True)
    pin_mmap_threshold()  # a flat memory floor under near-limit request lines (frontends/malloc_tuning.py)
    if not args.write_timeout > 0:
        raise ConfigError(f"--write-timeout must be positive; got {args.write_timeout}")
    if args.ray:
        if args.embedding or args.reranking:
            raise ConfigError("--embedding and --reranking are not served behind --ray")
        if args.socket is not None:
            raise ConfigError("--socket cannot be combined with --ray (the replicas serve HTTP only)")
        from spekula.frontends.ray.app import serve_on_ray

        return serve_on_ray(args)
    if args.replicas != 1 or args.ray_address is not None:
        raise ConfigError("--replicas and --ray-address need --ray")
    socket_path = args.socket if args.socket is not None or args.port is not None else default_socket_path()
    # Refuse a live socket or an unusable path before spending seconds loading the model.
    if socket_path is not None:
        check_socket_path(socket_path)
    defaults = server_defaults(args)
    rpc_config = None if socket_path is None else ServerConfig(
        socket_path, max_line_bytes=args.max_line_bytes, drain_timeout=args.drain_timeout,
        max_connections=args.max_connections, write_timeout=args.write_timeout,
        handle_signals=args.port is None)
    if args.port is None:
        assert rpc_config is not None
        engine = build_engine(args)
        server = RpcServer(engine, rpc_config, lambda srv: SpekulaMethods(engine, defaults, server_state=srv.state).table())
        try:
            anyio.run(server.serve)
        finally:
            engine.close()  # the loop has stopped: release slot sequences, then the model
            engine.backend.close()
        return 0
    return _serve_http(args, defaults, rpc_config)


def _serve_http(args: argparse.Namespace, defaults: ServerDefaults, rpc_config: ServerConfig | None) -> int:
    from spekula.frontends.http.server import HttpConfig, serve

    state = http_state(args)
    loaded: list[Engine] = []

    def load() -> Engine:
        engine = build_engine(args)
        loaded.append(engine)
        if engine.config.pooling is Pooling.RANK:
            state.rerank_format = RerankFormat.from_gguf(GGUFFile.shared(engine.backend.info.path), engine.tokenizer)
        return engine

    http = HttpConfig(host=args.host, port=args.port, drain_timeout=args.drain_timeout,
                      timeout_keep_alive=args.keep_alive_timeout, max_connections=args.max_connections,
                      header_timeout=args.header_timeout)
    try:
        anyio.run(partial(serve, load, state, http, defaults=defaults, rpc_config=rpc_config,
                          rpc_methods=lambda engine, srv: SpekulaMethods(engine, defaults, server_state=srv.state).table()))
    finally:
        for engine in loaded:
            engine.close()
            engine.backend.close()
    return 0
