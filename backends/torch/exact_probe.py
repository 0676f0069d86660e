"""Which fp32 CPU GEMM path is row-invariant on *this* machine, measured when a model loads.

Exact mode needs a GEMM whose row i does not depend on how many rows run with it. Whether a library
kernel has that property depends on the CPU: oneDNN's prepacked linear had it at every row count on an
AVX2 machine, but on an AVX-512/AMX one it broke at SmolLM2's 576x1536 shape, and MKL's row-count
padding needed multiples of 4 on one CPU and 16 on the other. So nothing is assumed: for each weight
shape of the model, random rows are multiplied alone and in batches of every size up to a few
micro-kernel heights, and a path is used only if every row came out bitwise the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import cache

import torch
import torch.nn.functional as F

ONEDNN_PACK_HINT = 4  # batch-size hint for oneDNN's weight reordering
ALIGN_CANDIDATES = (4, 8, 16, 32, 64)
_PROBE_ROWS = 66
# Columns are computed independently of each other, so a wide weight (the output head) is probed on its
# first columns only: the kernel choice depends on the row count and the reduction length.
_MAX_PROBE_COLS = 4096
# Every count up to two micro-kernel heights of 16, then the tail cases around 32 and 64 rows.
_COUNTS = (*range(1, 34), 47, 48, 49, 63, 64, 65, 66)


def onednn_packing_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, counts: Iterable[int],
                    pad_to: int = 1) -> bool:
    def run(rows: torch.Tensor) -> torch.Tensor:
        m = rows.shape[0]
        padded = -(-m // pad_to) * pad_to
        if padded != m:
            rows = torch.cat([rows, rows[-1:].expand(padded - m, -1)])
        return fn(rows)[:m]

    alone = torch.cat([run(x[i : i + 1]) for i in range(x.shape[0])])
    return all(torch.equal(run(x[:m]), alone[:m]) for m in counts)


@cache
def packed_is_invariant(n: int, k: int) -> bool:
    """oneDNN's prepacked fp32 linear gives a row the same bits at any row count, for an [n, k] weight."""
    if not onednn_packing_available():
        return False
    g = torch.Generator().manual_seed(n * 131 + k)
    w, x = torch.randn(min(n, _MAX_PROBE_COLS), k, generator=g), torch.randn(_PROBE_ROWS, k, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_PACK_HINT)

    def fn(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, None, "none", [], "")

    return _rows_invariant(fn, x, _COUNTS)


@cache
def padded_align(n: int, k: int) -> int | None:
    """The smallest row-count multiple at which plain F.linear (MKL) is row-invariant for [n, k], or None."""
    g = torch.Generator().manual_seed(n * 977 + k)
    w, x = torch.randn(min(n, _MAX_PROBE_COLS), k, generator=g), torch.randn(_PROBE_ROWS, k, generator=g)
    for align in ALIGN_CANDIDATES:
        if _rows_invariant(lambda rows: F.linear(rows, w), x, _COUNTS, pad_to=align):
            return align
    return None


@cache
def attention_align(n_keys: int, head_dim: int, group: int, scale: float) -> int | None:
    """The smallest multiple of query rows R at which the attention's batched GEMMs (the scores' baddbmm,
    then probs @ values, each on ``group * R`` rows: the heads sharing a KV head folded in) are
    row-invariant over a window of `n_keys` keys, or None. Measured on the batched calls as the backend
    makes them, with the model's score scale (where ``alpha`` is applied changes bits unless it is a power
    of two): their kernels need other multiples than F.linear's."""
    g = torch.Generator().manual_seed(n_keys * 613 + head_dim * 7 + group)
    # laid out as the backend's: keys and values are windows of a longer cache, the scores read keys transposed
    keys = torch.randn(2, 2 * n_keys, head_dim, generator=g)[:, :n_keys]
    vals = torch.randn(2, 2 * n_keys, head_dim, generator=g)[:, :n_keys]
    q, probs = torch.randn(_PROBE_ROWS, head_dim, generator=g), torch.rand(_PROBE_ROWS, n_keys, generator=g)

    def folded(rows: torch.Tensor) -> torch.Tensor:  # [2 KV heads, group * R, *], row r of head j = rows[r] + j
        heads = torch.cat([rows + j for j in range(group)])
        return torch.stack((heads, heads + 1))

    def scores(rows: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(group * rows.shape[0], n_keys)
        return torch.baddbmm(mask, folded(rows), keys.transpose(1, 2), alpha=scale)[1, : rows.shape[0]]

    def mix(rows: torch.Tensor) -> torch.Tensor:
        return torch.bmm(folded(rows), vals)[1, : rows.shape[0]]

    for align in ALIGN_CANDIDATES:
        if _rows_invariant(scores, q, _COUNTS, pad_to=align) and _rows_invariant(mix, probs, _COUNTS, pad_to=align):
            return align
    return None


def choose_exact_gemm(shapes: Iterable[tuple[int, int]], allow_packed: bool = True) -> tuple[bool, int | None]:
    """(use oneDNN packing, row alignment for the padded path) for a model with these [n, k] weights.

    Packing is chosen when every shape is invariant with it; else the padded MKL path with the
    largest alignment any shape needs; (False, None) when no candidate works (exact mode impossible)."""
    shapes = sorted(set(shapes))
    if allow_packed and all(packed_is_invariant(n, k) for n, k in shapes):
        return True, 1
    aligns = [padded_align(n, k) for n, k in shapes]
    if any(a is None for a in aligns):
        return False, None
    return False, max(a for a in aligns if a is not None)
