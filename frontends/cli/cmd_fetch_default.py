"""`spekula fetch-default`: download the embedded default model into the cache and print its path."""

from __future__ import annotations

import argparse

from spekula.backends.gguf.default_model import (
    default_model_path,
    ensure_default_model,
    remove_cached_default_model,
)

HELP = "Download the embedded default model (SmolLM2-135M-Instruct Q4_1) into the cache"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="fetch again even if a cached copy exists")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output on stderr")
    p.add_argument(
        "--print-path", action="store_true", help="only print where the model would be cached; fetch nothing"
    )


def run(args: argparse.Namespace) -> int:
    if args.print_path:
        print(default_model_path())
        return 0
    if args.force:
        remove_cached_default_model()
    print(ensure_default_model(quiet=args.quiet))
    return 0
