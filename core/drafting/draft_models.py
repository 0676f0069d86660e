"""Typed interface between model drafters and the runtimes of draft architectures (EAGLE-3, DFlash).

No torch here: arrays cross as numpy. A runtime owns a draft GGUF's weights (plus the target's token
embeddings / output head when the draft borrows them) and one KV cache per sequence, written by
position like the target's (``truncate`` is O(1)). Which class runs which draft kind on which
backend is a table the model drafters keep (drafters/model/runtimes.py); :func:`open_draft_runtime`
imports the class that table names, so a drafter never imports torch itself.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from spekula.core.backend import Backend, BackendOptions, ModelInfo
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.verify.sampling import pick
from spekula.core.verify.top_entries import bounded_top, partition_top

DRAFT_ARCHS = ("eagle3", "dflash")
N_CANDIDATES = 10  # llama.cpp's draft sampler keeps the top 10 candidates
SEED_XOR = 0x85EBCA6B  # probabilistic drafting seeds its sampler with the request seed XOR this


@dataclass(frozen=True, slots=True)
class DraftModelInfo:
    """What a drafter needs to know about a loaded draft model."""

    path: str
    arch: str  # eagle3 | dflash
    kind: str  # eagle3 | dflash | dspark (dflash with a Markov head)
    n_embd: int
    n_vocab: int  # the target vocabulary the logits are expressed in
    n_vocab_draft: int  # reduced draft vocabulary (== n_vocab without d2t)
    target_layers: tuple[int, ...]  # layer-input indices of the target to capture, in feature order
    target_hidden: int
    block_size: int = 0  # dflash only
    mask_token_id: int = -1  # dflash only
    sample_from_anchor: bool = False  # dspark: block [last, MASK*(n-1)] read from index 0
    has_confidence: bool = False  # dspark confidence head present


@dataclass(slots=True)
class Eagle3Rows:
    """Rows to decode for one sequence: entry k pairs ``tokens[k]`` with ``hidden[k]`` at ``start + k``."""

    seq_id: int
    tokens: np.ndarray  # int32 [n]
    hidden: np.ndarray  # float32 [n, n_embd]: fc output g (first step) or the previous step's pre-norm
    start: int
    want_logits: bool = True


@dataclass(slots=True)
class Eagle3Out:
    logits: np.ndarray | None  # float32 [n, n_vocab], -inf outside the draft vocabulary; None if not wanted
    prenorm: np.ndarray  # float32 [n, n_embd]: the layer output before output_norm (next step's hidden)
    # From draft_step only: the logits' columns are these target ids (a reduced draft vocabulary, each id
    # once) instead of the whole target vocabulary, so a step need not spread them over it.
    vocab: np.ndarray | None = None


@dataclass(slots=True)
class DFlashBlock:
    seq_id: int
    tokens: np.ndarray  # int32 [B]: [last, MASK, ...] at positions start .. start+B-1
    start: int
    # The block indices whose logits the caller reads, increasing (None: every index). DFlashOut's
    # logits and confidence then hold one row per listed index, in this order. Every row still takes
    # part in the block's attention; only the output head is spared for the others (over a target's
    # whole vocabulary it is most of a block's time, and a short draft reads two or three rows).
    logit_rows: Sequence[int] | None = None


@dataclass(slots=True)
class DFlashOut:
    # float32 [B, n_vocab]; for DSpark the Markov bias is already chained in (greedy), -inf outside the draft vocab
    logits: np.ndarray
    confidence: np.ndarray | None  # float32 [B] (DSpark with a confidence head), else None
    # When set, the logits' columns are these target ids (a reduced draft vocabulary, each id once)
    # instead of the whole target vocabulary, as in Eagle3Out.
    vocab: np.ndarray | None = None


class DraftRuntime(ABC):
    """Sequence bookkeeping shared by both architectures."""

    info: DraftModelInfo

    @property
    @abstractmethod
    def n_ctx(self) -> int:
        """Positions a sequence may hold."""

    @abstractmethod
    def new_seq(self) -> int: ...

    @abstractmethod
    def free_seq(self, seq_id: int) -> None: ...

    @abstractmethod
    def seq_len(self, seq_id: int) -> int: ...

    @abstractmethod
    def truncate(self, seq_id: int, n_keep: int) -> None:
        """Keep positions [0, n_keep)."""

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """A context shift of the sequence's cache (core/backend.py's `shift`): positions [n_keep,
        n_keep + n_discard) leave, later ones move down by n_discard with their keys re-roped. A runtime
        whose cache cannot do that keeps this refusal, and its drafter does not follow context shifts."""
        raise ConfigError(f"context shift is not supported by the {type(self).__name__} draft runtime")

    def share_cpu(self) -> None:  # noqa: B027 - optional hook
        """Another runtime's kernels (the native target's) use this process's cores: keep out of their
        way. Nothing to do unless the runtime has worker threads of its own."""


class Eagle3Runtime(DraftRuntime):
    @abstractmethod
    def encode(self, features: np.ndarray) -> np.ndarray:
        """Fused target features [T, 3*target_hidden] -> g [T, n_embd] (no positions, no cache)."""

    @abstractmethod
    def decode(self, rows: Sequence[Eagle3Rows]) -> list[Eagle3Out]:
        """One causal pass of the draft layer over every sequence's rows (written into its KV cache)."""

    def draft_step(self, rows: Sequence[Eagle3Rows]) -> list[Eagle3Out]:
        """One draft step: :meth:`decode` of each sequence's rows (their ``want_logits`` ignored), answering
        for its last row only (``logits`` [1, ...], ``prenorm`` [1, n_embd]). A runtime may answer over its
        reduced vocabulary (``Eagle3Out.vocab``) and from buffers it reuses, so an answer is only valid
        until the runtime's next call."""
        head = [Eagle3Rows(r.seq_id, r.tokens[:-1], r.hidden[:-1], r.start, False) for r in rows if len(r.tokens) > 1]
        if head:
            self.decode(head)
        return self.decode([Eagle3Rows(r.seq_id, r.tokens[-1:], r.hidden[-1:], r.start + len(r.tokens) - 1)
                            for r in rows])


class DFlashRuntime(DraftRuntime):
    @abstractmethod
    def inject(self, seq_id: int, features: np.ndarray, start: int) -> None:
        """Target features [T, len(target_layers)*n_embd] at positions start.. -> context K/V of every layer."""

    @abstractmethod
    def draft_blocks(self, blocks: Sequence[DFlashBlock]) -> list[DFlashOut]:
        """One non-causal forward per block (all sequences batched); block K/V are written at their positions."""


@dataclass(frozen=True, slots=True)
class DraftAttention:
    """A draft layer's attention shape, rope and norm epsilon, as both draft runtimes read them."""

    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    freq_scale: float  # 1 / the linear rope scaling factor (1 without scaling)
    eps: float


def read_draft_attention(f: GGUFFile, arch: str, n_embd: int) -> DraftAttention:
    """Head counts, head size, rope and norm epsilon from ``{arch}.*`` keys (llama.cpp defaults)."""
    n_head = int(f.require(f"{arch}.attention.head_count"))
    head_dim = int(f.get(f"{arch}.attention.key_length", n_embd // n_head))
    scale = float(f.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
    kind = f.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):  # the draft runtimes rope with one frequency scale only
        raise ModelFileError(f.path, f"draft heads with {kind!r} rope scaling are not supported (only linear)")
    return DraftAttention(
        n_head=n_head, n_head_kv=int(f.get(f"{arch}.attention.head_count_kv", n_head)), head_dim=head_dim,
        n_rot=int(f.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_base=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        freq_scale=1.0 / scale if f.get(f"{arch}.rope.scaling.type") == "linear" and scale > 0 else 1.0,
        eps=float(f.require(f"{arch}.attention.layer_norm_rms_epsilon")))


def read_draft_info(f: GGUFFile) -> DraftModelInfo:
    """Draft metadata from the GGUF, with clear errors for files that are not EAGLE-3/DFlash drafts."""
    arch = f.architecture
    if arch not in DRAFT_ARCHS:
        raise ModelFileError(f.path, f"architecture {arch!r} is not a model-drafter architecture ({', '.join(DRAFT_ARCHS)})")
    n_embd = int(f.require(f"{arch}.embedding_length"))
    tokens = f.get("tokenizer.ggml.tokens")
    n_vocab = int(f.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    if n_vocab <= 0:
        raise ModelFileError(f.path, "cannot tell the vocabulary size (no vocab_size key, no tokenizer)")
    layers = tuple(int(x) for x in f.require(f"{arch}.target_layers"))
    n_vocab_draft = f.tensor("d2t").shape[0] if f.has_tensor("d2t") else n_vocab
    if arch == "eagle3":
        if len(layers) != 3:
            raise ModelFileError(f.path, f"eagle3.target_layers must hold exactly 3 ids, got {list(layers)}")
        return DraftModelInfo(str(f.path), arch, "eagle3", n_embd, n_vocab, n_vocab_draft, layers,
                              int(f.require("eagle3.target_hidden_size")))
    if not layers:
        raise ModelFileError(f.path, "dflash.target_layers is empty")
    dspark = f.has_tensor("markov_w1.weight")
    return DraftModelInfo(
        str(f.path), arch, "dspark" if dspark else "dflash", n_embd, n_vocab, n_vocab_draft, layers, n_embd,
        block_size=int(f.require("dflash.block_size")),
        mask_token_id=int(f.require("tokenizer.ggml.mask_token_id")),
        sample_from_anchor=bool(f.get("dflash.sample_from_anchor", True)) if dspark else False,
        has_confidence=f.has_tensor("conf_proj.weight"),
    )


def check_target(info: DraftModelInfo, target: ModelInfo) -> None:
    """The draft reads the target's hidden states and vocabulary: refuse a target they do not fit."""
    if info.target_hidden != target.n_embd:
        raise ConfigError(f"draft model {info.path} expects target hidden size {info.target_hidden}, "
                          f"target {target.path} has {target.n_embd}")
    if info.n_vocab != target.n_vocab:
        raise ConfigError(f"draft model {info.path} has a vocabulary of {info.n_vocab} tokens, target {target.path} "
                          f"has {target.n_vocab}: the draft was made for another target")
    bad = [x for x in info.target_layers if not 0 <= x <= target.n_layer]
    if bad:
        raise ConfigError(f"draft model reads target layers {bad} but the target has {target.n_layer} layers")


@dataclass(frozen=True, slots=True)
class RuntimeEntry:
    """The class that runs one draft kind on one backend, as ``"module:Class"``."""

    class_path: str
    # Its constructor takes the target Backend as well (a native runtime runs over the target's
    # threads and prepared weights).
    shares_target: bool = False


# (backend name, draft kind or "mtp") -> the runtime class for it
RuntimeTable = Mapping[tuple[str, str], RuntimeEntry]


def runtime_class(runtimes: RuntimeTable, backend_name: str, kind: str, missing: str) -> tuple[type, RuntimeEntry]:
    """The class ``runtimes`` names for (backend, kind), imported; ConfigError(`missing`) when the table
    has none (an import error inside an existing module propagates)."""
    entry = runtimes.get((backend_name, kind))
    if entry is None:
        raise ConfigError(missing)
    module_name, _, attr = entry.class_path.partition(":")
    return getattr(importlib.import_module(module_name), attr), entry


def open_draft_runtime(runtimes: RuntimeTable, backend_name: str, gguf_path: str, target: ModelInfo,
                       options: BackendOptions | None = None,
                       target_backend: Backend | None = None) -> Eagle3Runtime | DFlashRuntime:
    """Open a draft GGUF and build the runtime ``runtimes`` names for its kind on ``backend_name``."""
    f = GGUFFile(gguf_path)
    info = read_draft_info(f)
    check_target(info, target)
    cls, entry = runtime_class(runtimes, backend_name, info.kind,
                               f"draft architecture {info.kind!r} has no runtime for backend {backend_name!r}")
    opts = options or BackendOptions()
    runtime: Eagle3Runtime | DFlashRuntime = (cls(f, info, target, opts, target_backend) if entry.shares_target
                                              else cls(f, info, target, opts))
    return runtime


@dataclass(slots=True)
class Choice:
    token: int
    p_top: float  # probability of the best candidate (softmax over the top 10): what p_min compares
    q: np.ndarray | None  # float32 [n_vocab] draft distribution (probabilistic drafting only)


def top_candidates(row: np.ndarray, n: int, vocab: np.ndarray | None = None) -> np.ndarray:
    """Positions of the ``n`` largest finite entries of ``row``, best first, ties to the lower id: the
    position itself, or ``vocab[position]`` when the row covers a reduced vocabulary.

    A draft step picks from a row as wide as the vocabulary, and a partial sort of all of it cost more
    than the draft model's own step: the group-maxima bound of core/verify/top_entries.py finds them. Rows
    where it does not apply (a NaN or an infinite maximum, too short to group) take a partition of
    their finite entries instead; the result is the same.
    """
    near = bounded_top(row, n, vocab)
    if near is not None:
        return near
    finite_ids = np.flatnonzero(np.isfinite(row))
    if len(finite_ids) == 0:
        raise ValueError("draft logits have no finite entry")
    return partition_top(row, min(n, len(finite_ids)), vocab, finite_ids)


def choose(logits: np.ndarray, temperature: float | None, rng: np.random.Generator | None, *,
           vocab: np.ndarray | None = None, n_vocab: int = 0) -> Choice:
    """llama.cpp's draft pick: top-10, softmax (at ``temperature`` when sampling, else 1), best or sampled.

    ``-inf`` entries (outside a reduced draft vocabulary) never enter the candidate list. A row over a
    reduced vocabulary gives ``vocab`` (its columns' token ids) and ``n_vocab`` (the width of ``q``):
    the pick is the one from that row spread over the whole vocabulary with ``-inf`` elsewhere.
    """
    if vocab is not None and n_vocab <= 0:
        raise ValueError("a row over a reduced vocabulary needs the whole vocabulary's width")
    row = np.asarray(logits)
    if row.dtype != np.float32:
        row = row.astype(np.float64)  # float32 stays: widening it is exact, so the order is the same
    at = top_candidates(row, N_CANDIDATES, vocab)
    ids = at if vocab is None else vocab[at]
    scaled = row[at].astype(np.float64) / (temperature if (rng is not None and temperature) else 1.0)
    e = np.exp(scaled - scaled.max())
    p = e / e.sum()
    if rng is None:
        return Choice(int(ids[0]), float(p[0]), None)
    q = np.zeros(len(row) if vocab is None else n_vocab, dtype=np.float32)
    q[ids] = p
    return Choice(pick(ids, p, float(rng.random())), float(p[0]), q)


def draft_rng(spec_sampling: str, temperature: float, seed: int) -> np.random.Generator | None:
    """The per-round sampler state for probabilistic drafting, None for greedy drafting."""
    if spec_sampling != "probabilistic" or temperature <= 0:
        return None
    return np.random.default_rng((int(seed) ^ SEED_XOR) & 0xFFFFFFFF)
