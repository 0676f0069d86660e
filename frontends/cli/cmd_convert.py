"""`spekula convert`: Hugging Face checkpoint (target, MoE target with MTP layers, EAGLE-3, DFlash, DSpark) -> GGUF."""

from __future__ import annotations

import argparse
import sys

from spekula.backends.convert.gguf_writer import OUTTYPES
from spekula.backends.convert.hf import convert
from spekula.backends.convert.vocab import KNOWN_PRE

HELP = "Convert a Hugging Face checkpoint (target, Qwen3-MoE/GLM-4.5-MoE target, EAGLE-3, DFlash, DSpark) to GGUF"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="folder with config.json and *.safetensors")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target-model-dir", default=None,
                        help="the target's HF folder (EAGLE-3/DFlash/DSpark need this or --target-model: "
                             "tokenizer, vocab, layers)")
    target.add_argument("--target-model", default=None, metavar="TARGET.gguf",
                        help="the target's GGUF file, for a draft whose target exists only as a GGUF: its "
                             "vocabulary is copied into the draft as stored")
    p.add_argument("--outtype", choices=list(OUTTYPES), default="f16", help="type of 2-D weights (default f16; q8_0 keeps rows that are not whole 32-value "
                        "blocks f16); vectors stay f32")
    p.add_argument("--outfile", required=True, help="GGUF file to write")
    p.add_argument("--pre", default=None, choices=list(KNOWN_PRE),
                   help="llama.cpp pre-tokenizer name (default: inferred from tokenizer.json)")
    mtp = p.add_mutually_exclusive_group()
    mtp.add_argument("--mtp", dest="mtp", action="store_const", const="only", default="keep",
                     help="write only the multi-token-prediction (nextn) layers of a GLM-4.5-MoE or Qwen3.5 checkpoint, "
                          "with its embedding, final norm and head: a draft file for draft-mtp")
    mtp.add_argument("--no-mtp", "--no-nextn", dest="mtp", action="store_const", const="drop",
                     help="leave the multi-token-prediction (nextn) layers out of the converted target")


def run(args: argparse.Namespace) -> int:
    layout, path = convert(args.checkpoint, args.outfile, outtype=args.outtype,
                           target_dir=args.target_model_dir, target_gguf=args.target_model, pre=args.pre,
                           mtp=args.mtp)
    print(f"wrote {path} ({layout}, {args.outtype})", file=sys.stderr)
    return 0
