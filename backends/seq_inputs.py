"""Validation of a forward pass's inputs, shared by the backends: one clear error per mistake."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from spekula.core.backend import Capture, SeqInput
from spekula.core.errors import ConfigError, ContextOverflowError

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
        # dtype.kind instead of np.issubdtype: a decode step's checks are a measurable part of its
        # bookkeeping (see _outside).
        if n and tokens.dtype.kind not in "iu":
            raise ConfigError(f"sequence {inp.seq_id}: tokens must be integers, got {tokens.dtype}")
        tokens = tokens.astype(np.int64)
        if _outside(tokens, n_vocab):
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
            if _outside(rows, n):
                raise ConfigError(f"sequence {inp.seq_id}: logit_rows out of range [0, {n})")
        out.append(CheckedInput(inp.seq_id, tokens, int(inp.start), rows))
    return out


def _outside(values: np.ndarray, end: int) -> bool:
    """Whether any of the int64 ``values`` is outside [0, end). One value (a decode step's token and its
    logit row) is read directly: numpy's min() and max() cost more than the rest of the step's checks."""
    if values.size == 1:
        return not 0 <= int(values[0]) < end
    return bool(values.size) and bool(values.min() < 0 or values.max() >= end)
