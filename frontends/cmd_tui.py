"""`spekula tui`: attach to a running server (--socket) or start an embedded engine (-m ...)."""

from __future__ import annotations

import argparse

from spekula.core.errors import ConfigError
from spekula.frontends.options import add_engine_options, build_engine, sampling_from_args
from spekula.frontends.rpc_params import ServerDefaults

HELP = "Terminal UI with live speculation statistics"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH",
                   help="attach to a running `spekula serve`; without it an embedded engine is started")
    p.add_argument("-p", "--prompt", help="submit this prompt as soon as the engine is ready")
    add_engine_options(p)


def run(args: argparse.Namespace) -> int:
    # Imported here so that `spekula --help` never pays for textual.
    from spekula.frontends.tui_app import EmbeddedSource, RemoteSource, Source, SpekulaApp

    source: Source
    if args.socket:
        if args.model:
            raise ConfigError("give either --socket (attach to a server) or -m (embedded engine), not both")
        source = RemoteSource(args.socket)
    else:
        defaults = ServerDefaults(sampling=sampling_from_args(args), n_predict=args.n_predict)
        source = EmbeddedSource(lambda: build_engine(args), defaults)
    # -n -1 (the option's default) means "the engine's default", which the server or defaults hold.
    n_predict = None if args.n_predict == -1 else args.n_predict
    app = SpekulaApp(source, n_predict=n_predict, initial_prompt=args.prompt)
    app.run()
    return 0
