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

from spekula.core.errors import ModelFileError
from spekula.core.gguf_file import GGUFFile

# Target architectures whose forward the drafter runtimes pair with (dense decoders spekula loads).
TRAINABLE_TARGET_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "glm4moe")


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
    arch = f.architecture
    if arch not in TRAINABLE_TARGET_ARCHS:
        raise ModelFileError(f.path, f"architecture {arch!r} is not a target spekula can train a drafter for "
                             f"(supported: {', '.join(TRAINABLE_TARGET_ARCHS)})")
    n_embd = int(f.require(f"{arch}.embedding_length"))
    n_head = int(f.require(f"{arch}.attention.head_count"))
    n_head_kv = int(f.get(f"{arch}.attention.head_count_kv") or n_head)
    head_dim = int(f.get(f"{arch}.attention.key_length") or n_embd // n_head)
    tokens = f.get("tokenizer.ggml.tokens")
    n_vocab = int(f.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    if n_vocab <= 0:
        raise ModelFileError(f.path, "cannot tell the vocabulary size")
    n_ff = f.get(f"{arch}.feed_forward_length")
    if isinstance(n_ff, (list, tuple, np.ndarray)):
        n_ff = max(int(x) for x in n_ff)
    return TargetFacts(
        path=str(path), arch=arch, n_vocab=n_vocab, n_embd=n_embd,
        n_layer=int(f.require(f"{arch}.block_count")), n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ff=int(n_ff or 4 * n_embd), rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        n_ctx_train=int(f.get(f"{arch}.context_length", 2048)),
    )


@dataclass(slots=True)
class TrainBatch:
    """B sequences padded to T. ``labels[b, t]`` is the target's greedy next token after reading
    ``tokens[b, :t+1]`` (its argmax at row t), ``-1`` at padding. ``features[b, t]`` are the target's
    layer inputs at position t for the head's ``layers``, concatenated in that order (float32).
    ``loss_mask[b, t]`` says whether predictions *of* label t count in the loss."""

    tokens: torch.Tensor  # int64 [B, T]
    labels: torch.Tensor  # int64 [B, T]
    features: torch.Tensor  # float32 [B, T, len(layers) * n_embd]
    valid: torch.Tensor  # bool [B, T]: real positions (not padding)
    loss_mask: torch.Tensor  # bool [B, T]


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
