"""Validation of a forward pass's inputs, shared by the backends: one clear error per mistake."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.backend import Capture, SeqInput
from ..core.errors import ConfigError, ContextOverflowError

# The default logit row ("the last one") of an input of n < 64 tokens, made once: read-only, so no caller
# can change what another sees.
_LAST_ROW = [np.array([n - 1] if n else [], dtype=np.int64) for n in range(64)]
for _row in _LAST_ROW:
    _row.flags.writeable = False


@dataclass(slots=True)
class CheckedInput:
    seq_id: int
    tokens: np.ndarray  # int64 [n]
    start: int
    logit_rows: np.ndarray  # int64 indices into tokens


def check_inputs(inputs: Sequence[SeqInput], capture: Capture, *, n_layer: int, n_vocab: int, n_ctx: int,
                 seq_len: Callable[[int], int]) -> list[CheckedInput]:
    """`seq_len(seq_id)` gives a live sequence's length (and raises for an unknown one)."""
    bad = [layer for layer in capture.layers if not 0 <= layer <= n_layer]
    if bad:
        raise ConfigError(f"capture layers {sorted(bad)} out of range [0, {n_layer}]")
    seen: set[int] = set()
    out: list[CheckedInput] = []
    for inp in inputs:
        if inp.seq_id in seen:
            raise ConfigError(f"sequence {inp.seq_id} appears twice in one forward")
        seen.add(inp.seq_id)
        length = seq_len(inp.seq_id)
        tokens = np.asarray(inp.tokens).reshape(-1)
        n = int(tokens.size)
        # dtype.kind instead of np.issubdtype, and one element read directly instead of min()/max() (here
        # and for the logit rows): a decode step checks one token and one row, and numpy's reductions
        # cost more than the rest of its forward's bookkeeping.
        if n and tokens.dtype.kind not in "iu":
            raise ConfigError(f"sequence {inp.seq_id}: tokens must be integers, got {tokens.dtype}")
        tokens = tokens.astype(np.int64)
        if n == 1:
            out_of_range = not 0 <= int(tokens[0]) < n_vocab
        else:
            out_of_range = bool(n) and (tokens.min() < 0 or tokens.max() >= n_vocab)
        if out_of_range:
            raise ConfigError(f"sequence {inp.seq_id}: token id out of range [0, {n_vocab})")
        if not 0 <= inp.start <= length:
            raise ConfigError(f"sequence {inp.seq_id}: start {inp.start} not in [0, {length}]")
        if inp.start + n > n_ctx:
            raise ContextOverflowError(
                f"sequence {inp.seq_id}: positions up to {inp.start + n} exceed n_ctx={n_ctx}")
        if inp.logit_rows is None:
            rows = _LAST_ROW[n] if n < len(_LAST_ROW) else np.array([n - 1], dtype=np.int64)
        else:
            rows = np.asarray(inp.logit_rows, dtype=np.int64).reshape(-1)
            if rows.size == 1:
                rows_out_of_range = not 0 <= int(rows[0]) < n
            else:
                rows_out_of_range = bool(rows.size) and (rows.min() < 0 or rows.max() >= n)
            if rows_out_of_range:
                raise ConfigError(f"sequence {inp.seq_id}: logit_rows out of range [0, {n})")
        out.append(CheckedInput(inp.seq_id, tokens, int(inp.start), rows))
    return out
