"""Gemma 4's mixture-of-experts FFN in PyTorch: the dense FFN and the routed experts side by side.

As llama.cpp's graph computes it (gguf/architecture.py's ``MoERecipe.beside_dense``), for the residual x
after attention and h = ffn_norm(x)::

    post_ffw_norm_1(dense(h)) + post_ffw_norm_2(experts(pre_ffw_norm_2(x)))

routed on ``rms_norm(x) / sqrt(n_embd) * ffn_gate_inp.scale`` (softmax, top-k, weights renormalised, each
times its expert's ``ffn_down_exps.scale``). The block's ``post_ffw_norm`` then norms the sum. Every step
is row-wise or a planned GEMM (the experts as moe.py runs them), so the exact mode's rule holds.
"""

from __future__ import annotations

import math

import torch

from spekula.backends.torch.moe import DenseFFN, MoEFFN


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), w, eps)
    y = torch.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y * w if w is not None else y


class DenseBesideExperts:
    def __init__(self, dense: DenseFFN, experts: MoEFFN, *, router_scale: torch.Tensor, pre_norm_2: torch.Tensor,
                 post_norm_1: torch.Tensor, post_norm_2: torch.Tensor, n_embd: int, eps: float) -> None:
        self.dense, self.experts, self.eps = dense, experts, eps
        self.router_scale = router_scale.float()  # routing is decided in float32 whatever the model dtype
        self.pre_norm_2, self.post_norm_1, self.post_norm_2 = pre_norm_2, post_norm_1, post_norm_2
        self.inv_sqrt_embd = 1.0 / math.sqrt(n_embd)

    def __call__(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The FFN half's output for rows h = ffn_norm(x) of the residual x (before the block's post-norm)."""
        dense = _rms(self.dense(h), self.post_norm_1, self.eps)
        route_input = torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * self.inv_sqrt_embd * self.router_scale
        experts = self.experts(_rms(x, self.pre_norm_2, self.eps), route_input)
        return dense + _rms(experts, self.post_norm_2, self.eps)
