"""A DFlash head's own output head over a draft vocabulary, cut from the target's:
``python -m spekula.training.head_vocabulary HEAD.gguf --vocab-from OTHER.gguf -o OUT.gguf [-m TARGET.gguf]``.

A DFlash head that borrows the target's output head pays for the whole vocabulary in every draft (on
SmolLM2's 49k ids, about a third of a call). This writes a copy of the head with, as its own
``output.weight``, the target head's rows of a draft vocabulary, its stored blocks copied as they are
(no re-quantizing: those ids' logits are the borrowed head's), and the ``d2t`` table that maps them back,
as ``spekula train-drafter dflash --draft-vocab N`` exports a new head. The draft vocabulary is another
head's ``d2t``: an EAGLE-3 head trained on the same data holds its N most frequent labels.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import numpy as np

from spekula.backends.convert.gguf_copy import as_stored, copy_fields, raw_reader, write_with_tensors
from spekula.backends.convert.output import atomic_output, check_output_path
from spekula.core.errors import ConfigError, ModelFileError, SpekulaError
from spekula.core.modelfile.gguf_file import GGUFFile


def vocabulary_of(path: str | os.PathLike[str], n_vocab: int) -> np.ndarray:
    """The target ids a head's ``d2t`` lists: distinct, within [0, n_vocab), ascending."""
    f = GGUFFile(path)
    if not f.has_tensor("d2t"):
        raise ModelFileError(f.path, "has no d2t: it names no draft vocabulary")
    ids = np.asarray(f.tensor("d2t").data, dtype=np.int64).reshape(-1)
    if ids.size == 0 or ids.min() < 0 or ids.max() >= n_vocab or np.unique(ids).size != ids.size:
        raise ModelFileError(f.path, f"d2t must list distinct target ids in [0, {n_vocab})")
    return np.sort(ids)


def checked_draft_ids(ids: np.ndarray, n_vocab: int) -> np.ndarray:
    """`ids` as int64, checked to be a draft vocabulary: ascending distinct target ids in [0, n_vocab)."""
    out = np.asarray(ids, dtype=np.int64).reshape(-1)
    if out.size == 0 or out.min() < 0 or out.max() >= n_vocab or np.any(np.diff(out) <= 0):
        raise ConfigError(f"the draft vocabulary must be ascending distinct ids in [0, {n_vocab})")
    return out


def with_draft_vocabulary(head_path: str | os.PathLike[str], target_path: str | os.PathLike[str],
                          ids: np.ndarray, out_path: str | os.PathLike[str]) -> Path:
    """Copy the DFlash head at `head_path` to `out_path` with the target head's rows of `ids` as its own
    output head and `ids` as its d2t."""
    src, dst = Path(head_path), Path(out_path)
    head, target = GGUFFile(src), GGUFFile(target_path)
    if head.architecture != "dflash" or head.has_tensor("markov_w1.weight"):
        what = "dspark" if head.has_tensor("markov_w1.weight") else head.architecture
        raise ConfigError(f"{src}: a {what} model; a draft vocabulary is cut here for DFlash heads only")
    if head.has_tensor("output.weight") or head.has_tensor("d2t"):
        raise ConfigError(f"{src}: already has its own output head; nothing to cut")
    name = "output.weight" if target.has_tensor("output.weight") else "token_embd.weight"
    rows = target.tensor(name)
    n_vocab, width = rows.shape
    n_embd = int(head.require("dflash.embedding_length"))
    if width != n_embd:
        raise ConfigError(f"{src}: {n_embd} wide, but the target's {name} is {width} wide: another target's head")
    ids = checked_draft_ids(ids, n_vocab)
    if dst.resolve() in (src.resolve(), Path(target_path).resolve()):
        raise ConfigError(f"output {dst} is an input file; choose another path")
    check_output_path(dst, "-o")
    reader, target_reader = raw_reader(head), raw_reader(target)
    stored = next(t for t in target_reader.tensors if t.name == name)
    kept = np.ascontiguousarray(np.asarray(stored.data)[ids])  # whole rows of blocks, as stored
    with atomic_output(dst, "-o") as tmp:
        writer = gguf.GGUFWriter(tmp, "dflash", endianess=reader.endianess)
        try:
            copy_fields(reader, writer)
            write_with_tensors(writer, [*as_stored(reader.tensors), ("output.weight", kept, stored.tensor_type),
                                        ("d2t", ids, gguf.GGMLQuantizationType.I64)], reader.endianess)
        finally:
            writer.close()
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spekula.training.head_vocabulary", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head", help="a DFlash head GGUF that borrows its target's output head")
    p.add_argument("--vocab-from", required=True, metavar="GGUF", help="a head whose d2t lists the draft vocabulary")
    p.add_argument("-m", "--model", default=None, help="the target GGUF (default: the embedded model)")
    p.add_argument("-o", "--output", required=True)
    a = p.parse_args(argv)
    try:
        if a.model is None:
            from spekula.backends.gguf.default_model import ensure_default_model

            a.model = str(ensure_default_model(quiet=True))
        target = GGUFFile(a.model)
        n_vocab = target.tensor("output.weight" if target.has_tensor("output.weight") else "token_embd.weight").shape[0]
        out = with_draft_vocabulary(a.head, a.model, vocabulary_of(a.vocab_from, n_vocab), a.output)
    except SpekulaError as exc:
        print(f"head_vocabulary: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
