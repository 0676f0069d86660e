"""`spekula truncate-model IN.gguf --layers K -o OUT.gguf`: a no-training draft model for draft-simple."""

from __future__ import annotations

import argparse
import sys

from spekula.backends.convert.truncate import truncate_gguf

HELP = "Write a layer-truncated copy of a GGUF model (a no-training draft model)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="IN.gguf", help="model to copy")
    p.add_argument("--layers", type=int, required=True, metavar="K", help="keep the first K transformer blocks")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="file to write")


def run(args: argparse.Namespace) -> int:
    r = truncate_gguf(args.model, args.output, args.layers)
    print(
        f"wrote {r.path}: {r.arch}, {r.n_layer_out} of {r.n_layer_in} layers, {r.n_tensors} tensors, "
        f"{r.n_bytes / 2**20:.1f} MiB (use it with --spec-type draft-simple -md {r.path})",
        file=sys.stderr,
    )
    return 0
