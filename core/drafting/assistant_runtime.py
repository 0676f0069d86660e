"""Typed interface between draft-mtp and the runtimes of KV-sharing assistant drafters (Gemma 4's
``gemma4-assistant``, as llama.cpp's MTP driver runs it with a shared memory).

No torch here: arrays cross as numpy. Such an assistant keeps no KV cache: its query-only blocks attend
to the target's own cache. One step pairs a token x with a hidden state h (the target's post-final-norm
hidden of the token before x, or the previous step's output, projected back to the target's width) at
the position P of x, reads the target's keys [0, P) of the sequence, and returns the logits of the next
token and the next h. Every step of one draft is at the same P (llama.cpp's and transformers' use).

The runtime must run on the target's own backend (it reads that backend's cache); which class does so is
the model drafters' table (drafters/model/runtimes.py, kind "assistant").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from spekula.core.drafting.draft_models import RuntimeTable, runtime_class
from spekula.core.drafting.mtp_runtime import MtpOut
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

if TYPE_CHECKING:
    from spekula.core.backend import Backend

# assistant architecture -> the target architecture whose KV it reads
ASSISTANT_TARGETS = {"gemma4-assistant": "gemma4"}


@dataclass(frozen=True, slots=True)
class AssistantInfo:
    path: str
    arch: str
    n_embd: int  # the target's width: the hidden states it reads and returns
    n_vocab: int


@dataclass(slots=True)
class AssistantRow:
    """One step of one target sequence: ``token`` with ``hidden`` at position ``pos``."""

    target_seq: int
    token: int
    hidden: np.ndarray  # float32 [n_embd]
    pos: int


class AssistantRuntime(ABC):
    info: AssistantInfo

    @abstractmethod
    def step(self, rows: Sequence[AssistantRow]) -> list[MtpOut]:
        """Each row's next-token logits and next hidden state, over the target's keys [0, pos)."""


def is_assistant_file(f: GGUFFile) -> bool:
    return str(f.architecture) in ASSISTANT_TARGETS


def read_assistant_info(f: GGUFFile) -> AssistantInfo:
    arch = str(f.architecture)
    if not f.has_tensor("token_embd.weight"):
        raise ModelFileError(f.path, "missing tensor 'token_embd.weight'")
    return AssistantInfo(str(f.path), arch, int(f.require(f"{arch}.embedding_length_out")),
                         int(f.tensor("token_embd.weight").shape[0]))


def check_assistant_fits(info: AssistantInfo, target_path: str, arch: str, n_embd: int, n_vocab: int) -> None:
    """The assistant drafts for the target's architecture, width and vocabulary."""
    if ASSISTANT_TARGETS[info.arch] != arch:
        raise ConfigError(f"assistant {info.path} ({info.arch}) drafts for {ASSISTANT_TARGETS[info.arch]} targets, "
                          f"target {target_path} is a {arch} model")
    if info.n_embd != n_embd:
        raise ConfigError(f"assistant {info.path} reads hidden states of width {info.n_embd}, "
                          f"target {target_path} has {n_embd}")
    if info.n_vocab != n_vocab:
        raise ConfigError(f"assistant {info.path} has a vocabulary of {info.n_vocab} tokens, "
                          f"target {target_path} has {n_vocab}")


def check_assistant_files(target_path: str, draft_path: str) -> AssistantInfo:
    """What :func:`open_assistant_runtime` checks, from the files' headers alone."""
    target = GGUFFile.shared(target_path)
    info = read_assistant_info(GGUFFile.shared(draft_path))
    arch = str(target.architecture)
    check_assistant_fits(info, target_path, arch, int(target.require(f"{arch}.embedding_length")),
                         int(target.tensor("token_embd.weight").shape[0]))
    return info


def open_assistant_runtime(runtimes: RuntimeTable, backend_name: str, target: Backend,
                           draft_path: str) -> AssistantRuntime:
    """The assistant of ``draft_path`` on the target's own backend ``backend_name``."""
    f = GGUFFile.shared(draft_path)
    info = read_assistant_info(f)
    check_assistant_fits(info, target.info.path, target.info.arch, target.info.n_embd, target.info.n_vocab)
    cls, _ = runtime_class(runtimes, backend_name, "assistant",
                           f"draft-mtp: {f.path} is a {info.arch!r} drafter, which reads the target's KV cache; "
                           f"the {backend_name} backend does not run it (use --backend native or torch)")
    runtime: AssistantRuntime = cls(f, info, target)
    return runtime
