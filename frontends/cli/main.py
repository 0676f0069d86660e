"""`spekula` console script: one subcommand per module `spekula.frontends.cmd_<name>`.

Each command module exposes ``HELP: str``, ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their subcommand runs, so `spekula generate` never imports textual
and `spekula tui` never imports onnxruntime.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from spekula.core.errors import SpekulaError

# Before any command module: the process's first import of structlog, without rich (see logging_setup).
from spekula.frontends import logging_setup  # noqa: F401
from spekula.frontends.cli.deferred_options import DeferringParser

COMMANDS: dict[str, str] = {
    "generate": "Generate text from a prompt (optionally with speculative decoding)",
    "serve": "Serve a JSON-RPC 2.0 API on a Unix socket",
    "tui": "Terminal UI with live speculation statistics",
    "convert": "Convert a Hugging Face checkpoint (target, Qwen3-MoE/GLM-4.5-MoE target, EAGLE-3, DFlash, DSpark) to GGUF",
    "truncate-model": "Write a layer-truncated copy of a GGUF model (a no-training draft model)",
    "train-drafter": "Train an EAGLE-3 or DFlash draft head for a target by self-distillation (CPU or CUDA)",
    "ngram-cache": "Build an ngram-cache static lookup file from a text corpus",
    "fetch-default": "Download the embedded default model (SmolLM2-135M-Instruct Q4_1) into the cache",
}


def _module_name(command: str) -> str:
    return "spekula.frontends.cli.cmd_" + command.replace("-", "_")


# What a process killed by SIGPIPE reports through the shell (128 + 13): `spekula ... | head -c1`
# ends the way `yes | head -c1` does, so `set -o pipefail` scripts see that the reader stopped early.
EXIT_BROKEN_PIPE = 141


class _Parser(DeferringParser):
    """argparse, but a rejected command line is one `spekula: error:` line like every other error,
    rather than the whole usage block followed by `spekula generate: error:`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"spekula: error: {message} (see '{self.prog} --help')\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="spekula", description="Speculative-decoding inference engine")
    # Subparsers are created with the root parser's class, so they share `_Parser.error`.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # only the chosen command's module is imported
            importlib.import_module(_module_name(name)).add_arguments(p)
    return parser


def normalize_option_names(argv: list[str]) -> list[str]:
    """llama.cpp accepts `--spec_type` for `--spec-type`: normalise `_` to `-` in long option names."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


# Whether this process runs as the console script (main() without argv) rather than a caller in-process.
_whole_process = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a stretch of start-up (imports, loading a model): start-up
    builds tens of thousands of containers that live to the end (modules, the vocabulary, the weights'
    descriptors), and each collection on the way walks them all again (~20 ms of `spekula generate`).
    In the console script, what exists afterwards is frozen (gc.freeze), so that no later collection,
    the interpreter's last ones at exit included, walks it either; a caller in-process keeps its collector
    as it was, since freezing would keep its garbage cycles forever."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if _whole_process:
            gc.freeze()
        gc.enable()


# numpy's OpenBLAS starts a worker thread per core when numpy is imported, and each polls for work for
# about 0.1 s before it sleeps: on a small machine that takes a core's share from the start-up it
# happens in. spekula makes no BLAS call through numpy (its matmuls are the native kernels, torch's or
# onnxruntime's), so the console script asks for none (an explicit setting wins).
_NO_BLAS_THREADS = {"OPENBLAS_NUM_THREADS": "1"}


def main(argv: list[str] | None = None) -> int:
    global _whole_process
    _whole_process = argv is None
    if _whole_process:
        for name, value in _NO_BLAS_THREADS.items():
            os.environ.setdefault(name, value)
    argv = normalize_option_names(list(sys.argv[1:] if argv is None else argv))
    try:
        with collector_paused():
            parser = build_parser(argv)
            args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return 2
        return int(importlib.import_module(_module_name(args.command)).run(args) or 0)
    except SpekulaError as exc:
        print(f"spekula: error: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        # `serve` loads the model inside its task group, so a file it refuses arrives wrapped.
        errors, rest = group.split(SpekulaError)
        if errors is None or rest is not None:
            raise
        for exc in _leaves(errors):
            print(f"spekula: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of our stdout went away (`| head`): nothing more can be said there, and
        # Python's flush at exit must not print a second error about it.
        silence_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        if _whole_process:
            gc.freeze()  # the process ends now: its final collections need not walk what it built



def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


def silence_stdout() -> None:
    """Point the stdout file descriptor at /dev/null, so the interpreter's final flush succeeds."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a descriptor (captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
