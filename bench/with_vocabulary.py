"""A model file with another file's vocabulary: the weights and every other key of MODEL, the tokenizer
keys (tokenizer.*) of VOCAB, written to OUT as stored (no block is requantized).

    python bench/with_vocabulary.py MODEL VOCAB -o OUT

The synthetic shapes of bench/synthetic_archs.py carry a padded vocabulary with almost no merges, which
understates what a tokenizer holds. llama.cpp's sdist ships real vocabularies (models/ggml-vocab-*.gguf,
e.g. Gemma 4's 262144 tokens with 514906 merges): this puts one on a synthetic shape of the same vocabulary
size, so that bench/vs_llama_server.py -m OUT compares both engines' memory with a real tokenizer.
"""

from __future__ import annotations

import argparse
import sys

import gguf

from spekula.backends.convert.gguf_copy import as_stored, copy_fields, write_with_tensors

TOKENIZER_PREFIX = "tokenizer."


def n_tokens(reader: gguf.GGUFReader, what: str) -> int:
    field = reader.get_field("tokenizer.ggml.tokens")
    if field is None:
        raise SystemExit(f"{what} has no vocabulary (tokenizer.ggml.tokens)")
    return len(field.data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("vocab")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    model, vocab = gguf.GGUFReader(args.model, "r"), gguf.GGUFReader(args.vocab, "r")
    n_model, n_vocab = n_tokens(model, args.model), n_tokens(vocab, args.vocab)
    if n_model != n_vocab:  # the embedding and output rows are the model's token count
        raise SystemExit(f"{args.vocab} has {n_vocab} tokens, {args.model} {n_model}: they must be equal")
    arch = model.get_field(gguf.Keys.General.ARCHITECTURE)
    writer = gguf.GGUFWriter(args.output, arch.contents() if arch is not None else "llama", endianess=model.endianess)
    try:
        copy_fields(model, writer, keep=lambda name: not name.startswith(TOKENIZER_PREFIX))
        copy_fields(vocab, writer, keep=lambda name: name.startswith(TOKENIZER_PREFIX))
        write_with_tensors(writer, as_stored(model.tensors), model.endianess)
    finally:
        writer.close()
    print(f"{args.output}: {args.model}'s weights with {args.vocab}'s {n_vocab}-token vocabulary")
    return 0


if __name__ == "__main__":
    sys.exit(main())
