"""The linear layer of the torch backend, built to the exact-mode GEMM plan of its weight shape."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from spekula.backends.torch.exact_probe import ONEDNN_PACK_HINT

# (n, k) of a weight -> (use oneDNN packing, row alignment of the padded path)
GemmPlan = Callable[[int, int], tuple[bool, int]]


def plain_gemm(n: int, k: int) -> tuple[bool, int]:
    return False, 1


class Lin:
    """y = x @ w.T (+ b): through a prepacked oneDNN kernel when ``packed`` (CPU fp32), else plain
    F.linear on row counts padded to a multiple of ``align`` (what makes MKL row-invariant here)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, *, packed: bool, align: int = 1) -> None:
        self.b = b
        self.align = align
        self.w: torch.Tensor | None = None if packed else w
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_PACK_HINT) if packed else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.b, "none", [], "")
        assert self.w is not None
        m = x.shape[0]
        extra = -m % self.align
        if not extra:
            return F.linear(x, self.w, self.b)
        padded = torch.cat([x, x[-1:].expand(extra, -1)])
        return F.linear(padded, self.w, self.b)[:m]


def planned_lin(plan: GemmPlan, w: torch.Tensor, b: torch.Tensor | None) -> Lin:
    packed, align = plan(int(w.shape[0]), int(w.shape[1]))
    return Lin(w, b, packed=packed, align=align)
