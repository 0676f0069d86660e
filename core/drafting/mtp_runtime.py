"""Typed interface between draft-mtp and the runtimes of multi-token-prediction (MTP, "nextn") heads.

No torch here: arrays cross as numpy. An MTP head is one extra decoder block stored after a target's
trunk (``blk.{n_layer + k}``) with a few ``nextn.*`` tensors around it. Entry k of a decode pairs
token x_P with a hidden state h (the target's post-final-norm hidden at P - 1, or the previous draft
step's output) at position P, and predicts x_{P+1}:

    u    = eh_proj([rmsnorm(E[x_P], enorm); rmsnorm(h, hnorm)])      (embedding first)
    u    = the architecture's decoder block over u at position P      (its own KV cache)
    hout = rmsnorm(u, shared_head_norm or output_norm)
    logits = (shared_head_head or output) . hout,  E = embed_tokens or token_embd

A runtime owns the heads' weights and one KV cache per sequence and head, written by position like
the target's (``truncate`` is O(1)). The heads come either from the target GGUF itself or from an
MTP-only GGUF (llama.cpp's converter ``--mtp`` output: the MTP blocks plus token_embd, output_norm,
output). GLM-4.5 stores the ``nextn.*`` tensors in every MTP block; Qwen3.5 stores its input projection
and head norm (``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.norm``) once, with the first MTP block, and its
later MTP blocks are decoder blocks only: head k then reads the first block's ``nextn.*`` around its
own block (as vLLM runs Qwen3.5's MTP layers; llama.cpp runs only one). Which class runs the heads on which backend is the model drafters' table
(drafters/model/runtimes.py, kind "mtp").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from spekula.core.drafting.draft_models import RuntimeTable, runtime_class
from spekula.core.errors import ConfigError, ContextOverflowError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

if TYPE_CHECKING:
    from spekula.core.backend import Backend, BackendOptions

# Architectures whose MTP blocks have a runtime: GLM-4.5's MoE block with a shared expert, Qwen3.5's gated
# full-attention block with the dense FFN (qwen35) or the MoE FFN with its gated shared expert (qwen35moe).
MTP_ARCHS = ("glm4moe", "qwen35", "qwen35moe")
# Architectures whose later MTP blocks share the first one's nextn.* tensors when they have none of their own.
SHARED_NEXTN_ARCHS = ("qwen35", "qwen35moe")
# Drafters llama.cpp runs as MTP over the target's KV (no cache of their own): only an -md file
# (core/drafting/assistant_runtime.py), never heads of a target.
KV_SHARING_ASSISTANT_ARCHS = ("gemma4-assistant",)


@dataclass(frozen=True, slots=True)
class MtpInfo:
    """What the drafter needs to know about the loaded heads."""

    path: str  # the GGUF the heads were read from (the target's own file without -md)
    arch: str
    n_heads: int  # nextn_predict_layers
    first_block: int  # GGUF block index of head 0 (the trunk's block count)
    n_embd: int
    n_vocab: int
    nextn_blocks: tuple[int, ...] = ()  # per head, the block whose nextn.* tensors it reads (default: its own)

    def block(self, head: int) -> int:
        """GGUF block index of head `head`'s decoder block."""
        return self.first_block + head

    def nextn_block(self, head: int) -> int:
        """GGUF block index holding head `head`'s nextn.* tensors (eh_proj, enorm, hnorm, shared_head_*)."""
        return self.nextn_blocks[head] if self.nextn_blocks else self.first_block + head


@dataclass(slots=True)
class MtpRows:
    """Rows of one sequence for one head: entry k pairs ``tokens[k]`` with ``hidden[k]`` at ``start + k``."""

    seq_id: int
    head: int
    tokens: np.ndarray  # int32 [n]
    hidden: np.ndarray  # float32 [n, n_embd]
    start: int
    want_last: bool = True  # return the last row's logits and output hidden


@dataclass(slots=True)
class MtpOut:
    logits: np.ndarray | None  # float32 [n_vocab] of the last row, None unless wanted
    hidden: np.ndarray | None  # float32 [n_embd]: the last row's hout (a chained step's h), None unless wanted


class MtpRuntime(ABC):
    info: MtpInfo

    @property
    @abstractmethod
    def n_ctx(self) -> int:
        """Positions a sequence may hold."""

    @abstractmethod
    def new_seq(self) -> int:
        """A sequence with an empty KV cache in every head."""

    @abstractmethod
    def free_seq(self, seq_id: int) -> None: ...

    @abstractmethod
    def seq_len(self, seq_id: int) -> int:
        """Positions written so far (the same bound for every head)."""

    @abstractmethod
    def truncate(self, seq_id: int, n_keep: int) -> None:
        """Keep positions [0, n_keep) in every head."""

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """A context shift of every head's cache (core/backend.py's `shift`); a runtime that cannot keeps
        this refusal."""
        raise ConfigError(f"context shift is not supported by the {type(self).__name__} MTP runtime")

    @abstractmethod
    def decode(self, rows: Sequence[MtpRows]) -> list[MtpOut]:
        """One causal pass per head over all its rows (every sequence batched); K/V are written at the rows' positions.

        Writing at ``start`` drops what the sequence held at or after ``start``; ``start`` must not
        exceed ``seq_len``.
        """


def decode_by_head(rows: Sequence[MtpRows], info: MtpInfo, decode_head: Callable[[int, list[MtpRows]], list[MtpOut]],
                   *, seq_len: Callable[[int], int], n_ctx: int) -> list[MtpOut]:
    """A runtime's ``decode``: every row checked before anything runs (head, shapes, token ids, a write
    that leaves no gap after ``seq_len(seq)`` and stays inside ``n_ctx``; no sequence twice under one
    head), then ``decode_head(head, its rows)`` once per head in head order; outputs come back in the
    rows' order."""
    by_head: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if not 0 <= r.head < info.n_heads:
            raise ValueError(f"MTP head {r.head} out of range (the model has {info.n_heads})")
        n = len(r.tokens)
        if n == 0 or np.shape(r.hidden) != (n, info.n_embd):
            raise ValueError(f"MTP rows need tokens [n > 0] and hidden [n, {info.n_embd}]")
        tokens = np.asarray(r.tokens)
        if tokens.min() < 0 or tokens.max() >= info.n_vocab:
            raise ValueError(f"MTP rows: token ids must be in [0, {info.n_vocab})")
        length = seq_len(r.seq_id)
        if r.start < 0:
            raise ValueError(f"MTP sequence {r.seq_id}: negative start {r.start}")
        if r.start > length:
            raise ConfigError(f"MTP sequence {r.seq_id}: write at {r.start} leaves a gap after {length}")
        if r.start + n > n_ctx:
            raise ContextOverflowError(f"MTP sequence {r.seq_id}: position {r.start + n - 1} exceeds n_ctx {n_ctx}")
        by_head.setdefault(r.head, []).append(i)
    for head, idx in by_head.items():
        seqs = [rows[i].seq_id for i in idx]
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"MTP head {head}: a sequence appears twice in one decode")
    outs = [MtpOut(None, None) for _ in rows]
    for head, idx in sorted(by_head.items()):
        for i, out in zip(idx, decode_head(head, [rows[i] for i in idx]), strict=True):
            outs[i] = out
    return outs


def read_mtp_info(f: GGUFFile) -> MtpInfo:
    """The MTP heads a GGUF holds, with one clear error when it holds none this runtime can run."""
    arch = str(f.architecture)
    if arch in KV_SHARING_ASSISTANT_ARCHS:
        raise ConfigError(f"--spec-type draft-mtp: {f.path} is a {arch!r} drafter, which attends over the target's "
                          "own KV cache: it drafts when given with -md beside its target, it holds no MTP heads "
                          f"of a target (supported MTP heads: {', '.join(MTP_ARCHS)})")
    n_heads = int(f.get(f"{arch}.nextn_predict_layers", 0) or 0)
    if n_heads <= 0:
        raise ConfigError(f"--spec-type draft-mtp: {f.path} ({arch}) has no multi-token-prediction layers "
                          f"({arch}.nextn_predict_layers is absent or 0); use a target converted with its MTP "
                          "layers, or give an MTP GGUF with -md")
    if arch not in MTP_ARCHS:
        raise ConfigError(f"--spec-type draft-mtp: MTP layers of {arch!r} models are not supported "
                          f"(supported: {', '.join(MTP_ARCHS)})")
    first = int(f.require(f"{arch}.block_count")) - n_heads

    def has_nextn(block: int) -> bool:
        return f.has_tensor(f"blk.{block}.nextn.eh_proj.weight")

    shared = arch in SHARED_NEXTN_ARCHS and first >= 0 and has_nextn(first)
    nextn = tuple(first + k if has_nextn(first + k) or not shared else first for k in range(n_heads))
    missing = [first + k for k in range(n_heads) if not has_nextn(nextn[k])]
    if first < 0 or missing:
        raise ModelFileError(f.path, f"{arch}.nextn_predict_layers is {n_heads} but blocks {missing or [first]} "
                                     "have no nextn.eh_proj tensor (converted without its MTP layers?)")
    if not f.has_tensor("token_embd.weight"):
        raise ModelFileError(f.path, "missing tensor 'token_embd.weight'")
    return MtpInfo(str(f.path), arch, n_heads, first, int(f.require(f"{arch}.embedding_length")),
                   int(f.tensor("token_embd.weight").shape[0]), nextn)


def check_mtp_fits(info: MtpInfo, target_path: str, arch: str, n_embd: int, n_vocab: int) -> None:
    """The heads belong to the target's architecture, read its final hidden states and predict in its vocabulary."""
    if info.arch != arch:
        raise ConfigError(f"MTP model {info.path} holds {info.arch} MTP layers, target {target_path} is a {arch} model")
    if info.n_embd != n_embd:
        raise ConfigError(f"MTP model {info.path} has hidden size {info.n_embd}, target {target_path} has {n_embd}")
    if info.n_vocab != n_vocab:
        raise ConfigError(f"MTP model {info.path} has a vocabulary of {info.n_vocab} tokens, "
                          f"target {target_path} has {n_vocab}")


def check_mtp_files(target_path: str, draft_path: str | None) -> MtpInfo:
    """Everything :func:`open_mtp_runtime` checks, from the files' headers alone (no weights loaded)."""
    target = GGUFFile.shared(target_path)
    info = read_mtp_info(GGUFFile.shared(draft_path) if draft_path else target)
    if draft_path:
        n_embd = int(target.require(f"{target.architecture}.embedding_length"))
        check_mtp_fits(info, target_path, str(target.architecture), n_embd,
                       int(target.tensor("token_embd.weight").shape[0]))
    return info


def open_mtp_runtime(runtimes: RuntimeTable, backend_name: str, target: Backend, draft_path: str | None,
                     options: BackendOptions) -> MtpRuntime:
    """The MTP heads of ``draft_path`` (an MTP GGUF given with -md) or, without one, of the target's own GGUF."""
    f = GGUFFile.shared(draft_path) if draft_path else GGUFFile.shared(target.info.path)
    info = read_mtp_info(f)
    check_mtp_fits(info, target.info.path, target.info.arch, target.info.n_embd, target.info.n_vocab)
    cls, _ = runtime_class(runtimes, backend_name, "mtp", f"MTP heads have no runtime for backend {backend_name!r}")
    runtime: MtpRuntime = cls(f, info, target, options)
    return runtime
