"""`spekula serve`: the JSON-RPC 2.0 server on a Unix socket (protocol in frontends/rpc_methods.py)."""

from __future__ import annotations

import argparse

import anyio
from spekula.core.errors import ConfigError
from spekula.frontends.logging_setup import configure_logging
from spekula.frontends.options import add_engine_options, build_engine, sampling_from_args
from spekula.frontends.rpc_framing import DEFAULT_MAX_LINE_BYTES, DEFAULT_WRITE_TIMEOUT
from spekula.frontends.rpc_methods import SpekulaMethods
from spekula.frontends.rpc_params import ServerDefaults
from spekula.frontends.server import DEFAULT_MAX_CONNECTIONS, RpcServer, ServerConfig, check_socket_path
from spekula.frontends.socket_identity import default_socket_path

HELP = "Serve a JSON-RPC 2.0 API on a Unix socket"
# The smallest useful request line: a completion call with a short prompt and a few fields takes a
# few hundred bytes, so a lower limit would reject every real request (a negative one all of them).
MIN_LINE_BYTES = 1024


def _line_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes, got {text!r}") from None
    if value < MIN_LINE_BYTES:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_LINE_BYTES} bytes, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--socket", default=default_socket_path(), metavar="PATH",
                   help="Unix socket path, created with mode 0600 (default: %(default)s)")
    g.add_argument("--max-line-bytes", type=_line_bytes, default=DEFAULT_MAX_LINE_BYTES, metavar="N",
                   help="longest accepted request line; longer ones get an error reply (default: 8 MiB)")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds to let in-flight requests finish (default: 30)")
    g.add_argument("--max-connections", type=_positive, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="open connections at most; more are told so and closed (default: %(default)s)")
    g.add_argument("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT, metavar="S",
                   help="disconnect a client that reads nothing for S seconds while replies wait (default: %(default)s)")
    add_engine_options(p)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose, stdlib=True, log_format=args.log_format, events=True)
    # Refuse a live socket or an unusable path before spending seconds loading the model.
    check_socket_path(args.socket)
    engine = build_engine(args)
    defaults = ServerDefaults(sampling=sampling_from_args(args), n_predict=args.n_predict)
    if not args.write_timeout > 0:
        raise ConfigError(f"--write-timeout must be positive; got {args.write_timeout}")
    config = ServerConfig(args.socket, max_line_bytes=args.max_line_bytes, drain_timeout=args.drain_timeout,
                          max_connections=args.max_connections, write_timeout=args.write_timeout)
    server = RpcServer(engine, config, lambda srv: SpekulaMethods(engine, defaults, server_state=srv.state).table())
    try:
        anyio.run(server.serve)
    finally:
        engine.close()  # the loop has stopped: release slot sequences, then the model
        engine.backend.close()
    return 0
