"""Gemma 4's per-layer inputs in PyTorch: each token's [n_layer, P] values the blocks add after their FFN.

As llama.cpp's graph computes them (gguf/block_layout.py): a projection of the scaled token embedding,
scaled by n_embd^-1/2 and RMS-normed per block's P values, plus the token's row of the per-layer
embedding table scaled by sqrt(P), the sum scaled by 1/sqrt(2). Every step is row-wise or a GEMM of
the planned shapes, so the exact mode's rule holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from spekula.backends.gguf.architecture import ModelHParams
from spekula.backends.torch.linear import Lin


class PerLayerInputs:
    def __init__(self, hp: ModelHParams, tensor: Callable[[str], torch.Tensor],
                 make_lin: Callable[[torch.Tensor, torch.Tensor | None], Lin]) -> None:
        self.n_layer, self.P, self.eps = hp.n_layer, hp.layout.n_embd_per_layer, hp.rms_eps
        self.table = tensor("per_layer_token_embd.weight")  # [n_vocab, n_layer * P]
        self.model_proj = make_lin(tensor("per_layer_model_proj.weight"), None)  # [n_layer * P, n_embd]
        self.norm = tensor("per_layer_proj_norm.weight")
        self.proj_scale = 1.0 / math.sqrt(hp.n_embd)
        self.table_scale = math.sqrt(self.P)

    def __call__(self, tokens: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """[M, n_layer, P] for a tile's tokens and their scaled embeddings x0 [M, n_embd]."""
        M = tokens.shape[0]
        proj = (self.model_proj(x0) * self.proj_scale).view(M, self.n_layer, self.P)
        if proj.dtype == torch.float32:
            proj = torch.rms_norm(proj, (self.P,), self.norm, self.eps)
        else:
            proj = torch.rms_norm(proj.float(), (self.P,), None, self.eps).to(proj.dtype) * self.norm
        own = F.embedding(tokens, self.table).view(M, self.n_layer, self.P) * self.table_scale
        return (proj + own) * (1.0 / math.sqrt(2.0))
