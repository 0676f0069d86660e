"""The Backend interface: everything the scheduler and the drafters may ask of a model runtime.

No torch here: arrays cross this boundary as numpy. A backend owns one model's weights and the KV
caches of its sequences. KV entries are written *by position*, so rolling back a rejected draft is
``truncate(seq, n_keep)`` and costs O(1): later writes simply overwrite the stale entries.

A recurrent (hybrid) model's sequence also carries a state that summarises every position so far and
cannot be cut back by position. Its backend (``ModelInfo.recurrent``) can rebuild only some lengths:
0, the current length, any length from its last :meth:`Backend.checkpoint` on (it keeps the state
there and what it needs to replay the rows after it) and the lengths it took a :meth:`Backend.snapshot`
at. Callers speculating take a checkpoint before the rows they may take back (the verification rows,
a draft model's draft steps) and ask :meth:`Backend.restorable` before reusing a cached prefix;
truncating to a length the backend cannot rebuild is a ConfigError. On KV-only models every length
up to the current one is restorable and both calls cost nothing.

A sequence's state can leave the backend and come back (a slot file, core/engine/slot_file.py):
:meth:`Backend.export_seq` gives it at the current length as named numpy arrays in the backend's own
layout, :meth:`Backend.import_seq` makes it a sequence's state. ``seq_state_format`` names that layout
(backend, dtypes), so a state is only ever imported by a backend that wrote the same layout. After an
import the sequence is at the state's length; a recurrent one can go back from there to 0 only, until
new checkpoints and snapshots are taken. A backend that cannot do this says so (ConfigError).

A context shift (``shift``, a server's --context-shift) takes a span out of the middle of a sequence and
moves the rest down; backends that cannot do it exactly say why in ``context_shift_refusal``.

Implementations live in ``spekula.backends.<name>`` and export ``backend_class``; they are loaded
by name through :func:`load_backend` so that onnxruntime is imported only when used.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from spekula.core.embedding import ClassifierHead, Pooling, pool
from spekula.core.errors import ConfigError

BACKEND_NAMES = ("auto", "native", "torch", "onnx")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What callers need to know about a loaded model (no weights)."""

    path: str
    arch: str  # llama | qwen2 | qwen3 | eagle3 | dflash ...
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx_train: int
    recurrent: bool = False  # some blocks keep a recurrent state: truncate reaches only restorable lengths


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """How to run a model. `n_ctx` bounds every sequence; `n_seq_max` bounds live sequences."""

    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | f32 | f16 | bf16
    n_ctx: int = 4096
    n_seq_max: int = 8
    threads: int = 0  # <= 0: leave the runtime's default
    exact: bool = True  # batch-invariant numerics (a row's logits do not depend on its batch)
    ort_provider: str = "auto"  # onnx only: auto | cuda | cpu
    # For a caller building the tokenizer while the backend loads in another thread (frontends/cli/in_thread.py),
    # both called from the loading thread. `on_setup_done`: the caller may start now (native: its Python setup
    # is done and its weights pack without the GIL, so the two do not take turns holding it; the others call it
    # at once). `before_head`: the load waits here before its last and largest growth (native: packing the
    # output head) until the caller's own peak is past. None: no call.
    on_setup_done: Callable[[], object] | None = field(default=None, compare=False, repr=False)
    before_head: Callable[[], object] | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class SeqInput:
    """New tokens of one sequence in a forward pass.

    Positions are ``start .. start+len(tokens)-1``; ``start`` must be <= the sequence's current
    length (writing at ``start`` implicitly truncates anything at or after it).
    """

    seq_id: int
    tokens: np.ndarray  # int32 [n]
    start: int
    # Indices into `tokens` whose logits are wanted. None means the last row only; empty means none.
    logit_rows: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class Capture:
    """Hidden states a drafter needs from the same forward pass (EAGLE-3, DFlash, MTP)."""

    # Layer-input indices: l means the residual entering block l (0 = token embeddings,
    # n_layer = residual after the last block, before output_norm). Returned for every row.
    layers: frozenset[int] = frozenset()
    final_norm: bool = False  # the hidden state after output_norm, every row

    def __bool__(self) -> bool:
        return bool(self.layers) or self.final_norm

    def union(self, other: Capture) -> Capture:
        return Capture(self.layers | other.layers, self.final_norm or other.final_norm)


@dataclass(slots=True)
class SeqOutput:
    logits: np.ndarray  # float32 [len(logit_rows), n_vocab]
    layer_inputs: dict[int, np.ndarray] = field(default_factory=dict)  # float32 [n, n_embd]
    hidden_final: np.ndarray | None = None  # float32 [n, n_embd], after output_norm


@dataclass(frozen=True, slots=True)
class SeqState:
    """A sequence's state at `length`: named arrays in its backend's layout (``Backend.seq_state_format``)."""

    length: int
    arrays: dict[str, np.ndarray]


class Backend(ABC):
    """A model runtime. Not thread-safe: the scheduler calls it from one worker thread at a time."""

    info: ModelInfo
    options: BackendOptions

    @property
    def n_ctx(self) -> int:
        return self.options.n_ctx

    @abstractmethod
    def new_seq(self) -> int:
        """Allocate an empty sequence (KV cache) and return its id."""

    @abstractmethod
    def free_seq(self, seq_id: int) -> None:
        """Release a sequence; its id may be reused."""

    @abstractmethod
    def seq_len(self, seq_id: int) -> int:
        """Number of positions currently held in the sequence's KV cache."""

    @abstractmethod
    def truncate(self, seq_id: int, n_keep: int) -> None:
        """Keep positions [0, n_keep); O(1) on KV-only models. On recurrent ones `n_keep` must be
        restorable (see :meth:`restorable`), else ConfigError."""

    def checkpoint(self, seq_id: int) -> None:  # noqa: B027 - KV-only models keep nothing
        """From now until the next checkpoint the sequence may be truncated back to any length from its
        current one on. Nothing to keep on KV-only models."""

    def snapshot(self, seq_id: int) -> None:  # noqa: B027 - KV-only models keep nothing
        """Keep the sequence's state at its current length so a later truncate to exactly that length
        works (a prompt cache's reuse point). A recurrent backend keeps a few per sequence, dropping the
        oldest; nothing to keep on KV-only models."""

    def restorable(self, seq_id: int, n_keep: int) -> int:
        """The longest length <= `n_keep` that truncate can bring the sequence back to."""
        return max(0, min(int(n_keep), self.seq_len(seq_id)))

    @property
    def seq_state_format(self) -> str:
        """What an exported state's arrays are (backend, dtypes, layout): states import only where it is equal."""
        return ""

    def export_seq(self, seq_id: int) -> SeqState:
        """The sequence's state at its current length (KV rows, a recurrent model's state, a ring's bounds)."""
        raise ConfigError(f"the {type(self).__name__} backend cannot export a sequence's state (slot save); "
                          "the native and torch backends can")

    def import_seq(self, seq_id: int, state: SeqState) -> None:
        """Make `state` (an `export_seq` of the same format) the sequence's state. A state whose arrays do not
        fit is a ConfigError and leaves the sequence as it was."""
        raise ConfigError(f"the {type(self).__name__} backend cannot import a sequence's state (slot restore); "
                          "the native and torch backends can")

    def context_shift_refusal(self) -> str | None:
        """Why this backend cannot shift a sequence's context with this model (None: it can)."""
        return f"context shift is not supported by the {type(self).__name__} backend"

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Context shift: drop positions [n_keep, n_keep + n_discard) and move the later ones down by
        n_discard, their keys re-roped to their new positions, as if computed there (within float
        rounding: keys are rotated from what the cache stores). ConfigError where unsupported."""
        raise ConfigError(self.context_shift_refusal() or f"{type(self).__name__} does not implement shift")

    @abstractmethod
    def forward(self, inputs: Sequence[SeqInput], capture: Capture = Capture()) -> list[SeqOutput]:
        """Run all sequences' new tokens in one pass; one output per input, in order."""

    def classifier_head(self) -> ClassifierHead | None:
        """The model's reranking head (rank pooling), None when the model file has none."""
        return None

    def embed(self, seq_id: int, tokens: np.ndarray, pooling: Pooling, n_batch: int) -> np.ndarray:
        """The embedding of `tokens` as a whole sequence: the hidden states after the final norm,
        pooled (core/embedding.py). Runs them in `seq_id` from position 0 in forwards of at most
        `n_batch` rows (each row's state is causal, so chunking changes nothing) and leaves the sequence
        holding them. [n, n_embd] for pooling none, [n_embd] for mean/cls/last, [n_labels] for rank."""
        if len(tokens) == 0:
            raise ValueError("cannot embed an empty sequence")
        head = self.classifier_head() if pooling is Pooling.RANK else None
        if pooling is Pooling.RANK and head is None:
            raise ConfigError(f"rank pooling needs a reranker GGUF with a classifier head (cls.output); "
                              f"{self.info.path} has none")
        self.truncate(seq_id, 0)
        rows: list[np.ndarray] = []
        no_logits = np.zeros(0, np.int64)
        for start in range(0, len(tokens), max(1, n_batch)):
            chunk = np.ascontiguousarray(tokens[start:start + n_batch], dtype=np.int32)
            out = self.forward([SeqInput(seq_id, chunk, start, no_logits)], Capture(final_norm=True))[0]
            assert out.hidden_final is not None
            rows.append(out.hidden_final)
        return pool(np.concatenate(rows, axis=0), pooling, head)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free device memory early (optional)."""


def resolve_backend_name(name: str, options: BackendOptions) -> str:
    """`auto` is the fastest exact path for the device: the native kernels over the GGUF blocks on the
    CPU, torch on CUDA or when a float dtype is asked for, onnx for its q4 graphs."""
    if name != "auto":
        return name
    if options.device.strip().lower() != "cpu" or options.dtype in ("f32", "f16", "bf16"):
        return "torch"
    if options.dtype == "q4":
        return "onnx"
    return "native"


def backend_class(name: str, options: BackendOptions) -> Callable[[str, BackendOptions], Backend]:
    """Import ``spekula.backends.<name>.backend`` lazily and return its ``backend_class``."""
    if name not in BACKEND_NAMES:
        raise ConfigError(f"unknown backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
    module = importlib.import_module(f"spekula.backends.{resolve_backend_name(name, options)}.backend")
    return module.backend_class  # type: ignore[no-any-return]


def load_backend(name: str, model_path: str, options: BackendOptions | None = None) -> Backend:
    """Import ``spekula.backends.<name>.backend`` lazily and build its ``backend_class``."""
    options = options or BackendOptions()
    return backend_class(name, options)(model_path, options)
