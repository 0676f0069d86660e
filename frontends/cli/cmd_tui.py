"""`spekula tui`: attach to a running server (--socket) or start an embedded engine (-m ...).

Everything that can fail on bad input (the model file, the drafters, the socket, the terminal) is
checked before the Textual app starts, so a mistake is one `spekula: error:` line on the shell
rather than a message inside a full-screen UI that, without a terminal, would never exit.
"""

from __future__ import annotations

import argparse
import sys

from spekula.core.errors import ConfigError
from spekula.frontends.cli.options import add_engine_options, build_engine, sampling_from_args
from spekula.frontends.logging_setup import configure_logging
from spekula.frontends.schema.completion import ServerDefaults

HELP = "Terminal UI with live speculation statistics"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH",
                   help="attach to a running `spekula serve`; without it an embedded engine is started")
    p.add_argument("-p", "--prompt", help="submit this prompt as soon as the engine is ready")
    add_engine_options(p)


def _check_server(path: str) -> None:
    """Connect once, so a wrong path or a dead server fails here (ServerGoneError says which)."""
    from spekula.frontends.rpc.client import SpekulaClient

    with SpekulaClient(path, timeout=10) as client:
        client.health()


def _check_terminal() -> None:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise ConfigError("spekula tui needs a terminal (stdin and stdout are not both a tty); "
                          "for scripts use `spekula generate` or `spekula serve`")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.verbose, log_format=getattr(args, "log_format", "text"))
    if args.socket and (args.model or args.hf_repo):
        raise ConfigError("give either --socket (attach to a server) or -m/-hf (embedded engine), not both")
    engine = None
    if args.socket:
        _check_server(args.socket)
    else:
        # Loading takes seconds, but a bad model or drafter must fail before the screen is taken over.
        engine = build_engine(args)
    try:
        _check_terminal()
        # Imported here so that `spekula --help` never pays for textual.
        from spekula.frontends.tui.app import EmbeddedSource, RemoteSource, Source, SpekulaApp

        source: Source
        if engine is None:
            source = RemoteSource(args.socket)
        else:
            defaults = ServerDefaults(sampling=sampling_from_args(args), n_predict=args.n_predict)
            loaded = engine
            source = EmbeddedSource(lambda: loaded, defaults)
        # -n -1 (the option's default) means "the engine's default", which the server or defaults hold.
        n_predict = None if args.n_predict == -1 else args.n_predict
        app = SpekulaApp(source, n_predict=n_predict, initial_prompt=args.prompt)
        app.run()
    finally:
        if engine is not None:
            engine.backend.close()
    return 0
