"""Embeddings from a decoder's hidden states: pooling, the reranker's classifier head, normalisation.

What is pooled is the hidden state after the final norm (``Capture.final_norm``), one row per prompt
token, as llama.cpp takes it. The pooling types and their numbers are llama.cpp's (`{arch}.pooling_type`
in a GGUF): none (every token's vector), mean, cls (the first token), last (the last token) and rank (a
reranker's score: the last token of a causal model through its classifier head). Pure numpy; the
backends compute the hidden states (`Backend.embed`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from spekula.core.errors import ConfigError


class Pooling(enum.Enum):
    NONE = "none"
    MEAN = "mean"
    CLS = "cls"
    LAST = "last"
    RANK = "rank"


# llama.cpp's enum llama_pooling_type, as written in `{arch}.pooling_type`
POOLING_BY_GGUF_ID = {0: Pooling.NONE, 1: Pooling.MEAN, 2: Pooling.CLS, 3: Pooling.LAST, 4: Pooling.RANK}
EUCLIDEAN = 2  # llama-server's default --embd-normalize


def parse_pooling(name: str) -> Pooling:
    try:
        return Pooling(name.strip().lower())
    except ValueError:
        raise ConfigError(f"--pooling must be one of {', '.join(p.value for p in Pooling)}; got {name!r}") from None


def pooling_from_gguf_id(value: object) -> Pooling | None:
    """The model file's declared pooling, or None (undeclared, or llama.cpp's -1 "unspecified")."""
    if value is None:
        return None
    try:
        return POOLING_BY_GGUF_ID.get(int(value))  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class ClassifierHead:
    """A decoder reranker's head over the pooled hidden state, as llama.cpp applies it: the output
    projection `cls.output`, then a softmax over the labels where the architecture asks for one (Qwen3
    rerankers: P(yes), P(no)). The score is the first output."""

    out_weight: np.ndarray  # float32 [n_labels, n_embd]
    softmax: bool = False
    labels: tuple[str, ...] = ()

    def __call__(self, pooled: np.ndarray) -> np.ndarray:
        y = self.out_weight.astype(np.float64) @ pooled.astype(np.float64)
        if self.softmax:
            y = np.exp(y - y.max())
            y = y / y.sum()
        return y.astype(np.float32)


def pool(hidden: np.ndarray, pooling: Pooling, head: ClassifierHead | None = None) -> np.ndarray:
    """`hidden` [n, n_embd] (a whole sequence, n >= 1) -> [n, n_embd] for none, [n_embd] for mean, cls and
    last, [n_labels] for rank (which needs the model's classifier head)."""
    if hidden.shape[0] == 0:
        raise ValueError("nothing to pool: the sequence is empty")
    if pooling is Pooling.NONE:
        return hidden
    if pooling is Pooling.MEAN:
        return hidden.astype(np.float64).mean(axis=0).astype(np.float32)
    if pooling is Pooling.CLS:
        return hidden[0]
    if pooling is Pooling.LAST:
        return hidden[-1]
    if head is None:
        raise ConfigError("rank pooling needs a reranker model (a classifier head, cls.output)")
    return head(hidden[-1])  # causal models are ranked by their last token, as llama.cpp does


def normalize(vector: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's embedding normalisation: -1 none, 0 max-absolute scaled to the int16 range, 1 taxicab,
    2 euclidean, p > 2 the p-norm. A zero vector stays zero."""
    v = vector.astype(np.float64)
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = float(np.abs(v).max(initial=0.0)) / 32760.0
    elif norm == 2:
        total = math.sqrt(float(v @ v))
    else:
        total = float((np.abs(v) ** norm).sum()) ** (1.0 / norm)
    scale = 1.0 / total if total > 0.0 else 0.0
    return (v * scale).astype(np.float32)
