"""What a trainable draft head is, to the training loop: one typed Protocol and the data it eats.

The loop (training/loop.py) owns data order, optimisation, checkpoints and progress; a head owns its
forward, its loss and how it is written out as a Hugging Face checkpoint that ``spekula convert``
accepts. Heads read the target only through :class:`TargetFacts` and the target's own token
embeddings / output head (frozen, never exported).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.recipes import ARCHITECTURES
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

# Heads train against any target the backends load: its hidden states are all the head reads.
TRAINABLE_TARGET_ARCHS = tuple(ARCHITECTURES)


@dataclass(frozen=True, slots=True)
class TargetFacts:
    """The target model's shape, read from its GGUF metadata."""

    path: str
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_theta: float
    rms_eps: float
    n_ctx_train: int


def read_target_facts(path: str) -> TargetFacts:
    """TargetFacts of a target GGUF; a clear error for files the trainer cannot train a head for."""
    f = GGUFFile(path)
    if f.architecture not in TRAINABLE_TARGET_ARCHS:
        raise ModelFileError(f.path, f"architecture {f.architecture!r} is not a target spekula can train a drafter "
                             f"for (supported: {', '.join(TRAINABLE_TARGET_ARCHS)})")
    hp = read_hparams(f)  # the same reading (and checks) the backends load the target with
    n_ff = hp.n_ff or (hp.moe.n_ff_exp * hp.moe.n_expert_used if hp.moe is not None else 4 * hp.n_embd)
    return TargetFacts(path=str(path), arch=hp.arch, n_vocab=hp.n_vocab, n_embd=hp.n_embd, n_layer=hp.n_layer,
                       n_head=hp.n_head, n_head_kv=hp.n_head_kv, head_dim=hp.head_dim, n_ff=n_ff,
                       rope_theta=hp.rope_base, rms_eps=hp.rms_eps, n_ctx_train=hp.n_ctx_train)


@dataclass(slots=True)
class TrainBatch:
    """B sequences padded to T. ``labels[b, t]`` is the target's greedy next token after reading
    ``tokens[b, :t+1]`` (its argmax at row t), ``-1`` at padding. ``features[b, t]`` are the target's
    layer inputs at position t for the head's ``layers``, concatenated in that order (float32).
    ``loss_mask[b, t]`` says whether predictions *of* label t count in the loss. With soft labels,
    ``soft_ids[b, t]`` are the target's K likeliest tokens at row t (label first, ``-1`` at padding)
    and ``soft_logp[b, t]`` their log-probabilities; heads then learn the target's whole top-K."""

    tokens: torch.Tensor  # int64 [B, T]
    labels: torch.Tensor  # int64 [B, T]
    features: torch.Tensor  # float32 [B, T, len(layers) * n_embd]
    valid: torch.Tensor  # bool [B, T]: real positions (not padding)
    loss_mask: torch.Tensor  # bool [B, T]
    soft_ids: torch.Tensor | None = None  # int64 [B, T, K]
    soft_logp: torch.Tensor | None = None  # float32 [B, T, K]


def soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per row, the cross-entropy of ``logits`` against the target's top-K distribution renormalised
    over its entries that exist here (``ids`` index the logits' columns, ``-1`` where the token does
    not: padding, or outside a reduced draft vocabulary). Rows must keep at least one entry."""
    present = ids >= 0
    p = torch.softmax(torch.where(present, logp.float(), float("-inf")), dim=-1)
    taken = F.log_softmax(logits.float(), dim=-1).gather(-1, ids.clamp(min=0))
    return -(torch.where(present, p * taken, 0.0)).sum(-1)


@dataclass(slots=True)
class HeadMetrics:
    """Per draft position k (0 = the first drafted token): how often the head's argmax equals the
    target's label given correct inputs before it, and how many predictions that counts."""

    correct: list[float] = field(default_factory=list)
    count: list[float] = field(default_factory=list)

    def accuracy(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.count, strict=True)]

    def expected_accept_length(self, n_max: int) -> float:
        """1 (the target's own token) + expected accepted drafts if draft k is right with acc[k]
        independently of the others: a rough estimate for the progress line, not a measurement."""
        acc = self.accuracy()[:n_max]
        total, run = 1.0, 1.0
        for a in acc:
            run *= a
            total += run
        return total

    def add(self, other: HeadMetrics) -> None:
        n = max(len(self.correct), len(other.correct))
        self.correct += [0.0] * (n - len(self.correct))
        self.count += [0.0] * (n - len(self.count))
        for i, (c, k) in enumerate(zip(other.correct, other.count, strict=True)):
            self.correct[i] += c
            self.count[i] += k


class DraftHead(Protocol):
    """A trainable draft model (a torch.nn.Module) the loop optimises and exports."""

    kind: str  # "eagle3" | "dflash"
    layers: tuple[int, ...]  # target layer-input indices it reads, in feature order

    def parameters(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def loss(self, batch: TrainBatch, gen: torch.Generator) -> tuple[torch.Tensor, HeadMetrics]:
        """Mean training loss over the batch (differentiable) and its accuracy counts. ``gen`` is the
        only randomness a head may use (so a fixed seed and step give the same loss)."""
        ...

    def hf_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(config.json contents, tensors by HF name) in a layout ``spekula convert`` accepts."""
        ...
