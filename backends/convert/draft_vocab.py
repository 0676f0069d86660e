"""Embeddings, output head and d2t of a draft checkpoint (EAGLE-3, DFlash/DSpark) -> GGUF tensors.

Both draft converters keep these the same way: optional own embeddings over the target vocabulary,
an optional head over the draft vocabulary, and a d2t table that a reduced draft vocabulary needs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spekula.backends.convert.gguf_writer import GGUFOut
from spekula.backends.convert.source import HFCheckpoint
from spekula.core.errors import ModelFileError


def d2t_absolute(offsets: np.ndarray, n_vocab_target: int, where: Path) -> np.ndarray:
    """HF stores ``target_id - draft_id``; llama.cpp stores the target id itself."""
    ids = offsets.astype(np.int64).reshape(-1) + np.arange(offsets.size, dtype=np.int64)
    if np.any((ids < 0) | (ids >= n_vocab_target)):
        raise ModelFileError(where, f"d2t maps to target ids outside [0, {n_vocab_target})")
    if np.unique(ids).size != ids.size:
        raise ModelFileError(where, "d2t maps two draft ids to the same target id")
    return ids


def write_embeddings(out: GGUFOut, ckpt: HFCheckpoint, top: dict[str, str], n_vocab_t: int, hidden: int,
                     where: Path) -> None:
    """token_embd.weight from the draft's own embed_tokens, if it has them ([target vocab, hidden])."""
    if "embed_tokens.weight" not in top:
        return
    if ckpt.shape(top["embed_tokens.weight"]) != (n_vocab_t, hidden):
        raise ModelFileError(where, f"embed_tokens shape {ckpt.shape(top['embed_tokens.weight'])} "
                             f"!= ({n_vocab_t}, {hidden})")
    out.tensor("token_embd.weight", ckpt.get(top["embed_tokens.weight"]))


def write_head(out: GGUFOut, ckpt: HFCheckpoint, top: dict[str, str], n_vocab_d: int, hidden: int,
               where: Path) -> None:
    """output.weight from the draft's lm_head ([draft vocab, hidden]); the caller decides whether to keep it."""
    if ckpt.shape(top["lm_head.weight"]) != (n_vocab_d, hidden):
        raise ModelFileError(where, f"lm_head shape {ckpt.shape(top['lm_head.weight'])} != ({n_vocab_d}, {hidden})")
    out.tensor("output.weight", ckpt.get(top["lm_head.weight"]))


def write_d2t(out: GGUFOut, ckpt: HFCheckpoint, top: dict[str, str], n_vocab_d: int, n_vocab_t: int,
              where: Path) -> None:
    """d2t as absolute target ids; a draft vocabulary smaller than the target's must have one."""
    if "d2t" in top:
        d2t = ckpt.get(top["d2t"])
        if d2t.size != n_vocab_d:
            raise ModelFileError(where, f"d2t has {d2t.size} entries but draft_vocab_size is {n_vocab_d}")
        out.i64("d2t", d2t_absolute(d2t, n_vocab_t, where))
    elif n_vocab_d != n_vocab_t:
        raise ModelFileError(where, f"draft_vocab_size {n_vocab_d} < vocab_size {n_vocab_t} but no d2t table")
