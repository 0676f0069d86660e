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
from typing import Any

import gguf

TOKENIZER_PREFIX = "tokenizer."


def copy_keys(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, keep: Any) -> None:
    """The keys of `reader` for which keep(name) holds, each with its stored value type."""
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or not keep(field.name):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


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
    writer = gguf.GGUFWriter(args.output, arch.contents() if arch is not None else "llama")
    try:
        copy_keys(model, writer, lambda name: not name.startswith(TOKENIZER_PREFIX))
        copy_keys(vocab, writer, lambda name: name.startswith(TOKENIZER_PREFIX))
        for t in model.tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in model.tensors:
            writer.write_tensor_data(t.data)
    finally:
        writer.close()
    print(f"{args.output}: {args.model}'s weights with {args.vocab}'s {n_vocab}-token vocabulary")
    return 0


if __name__ == "__main__":
    sys.exit(main())
