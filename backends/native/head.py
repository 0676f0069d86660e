"""What the one-context native draft-head runtimes (EAGLE-3, DFlash) share: the context's lifetime,
its per-sequence KV slots, and the token embedding and output head a head borrows from its target.

Such a runtime is one native context made over the native target's (its threads, and the target's
prepared embedding and head where the head has none of its own). draft-mtp's runtime holds one
context per head and keeps its own bookkeeping (backends/native/mtp.py).
"""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar

import numpy as np

from spekula.backends.context_shift import check_shift
from spekula.backends.native import lib as nl
from spekula.backends.native.weights import NativeWeights
from spekula.backends.seq_slots import PooledSeqs, SlotPool
from spekula.core.backend import BackendOptions, ModelInfo
from spekula.core.drafting.draft_models import DraftModelInfo
from spekula.core.errors import ConfigError, ContextOverflowError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile


class NativeHeadContext(PooledSeqs):
    """Mixin (listed before the runtime's ABC): close, the KV slots of ``self._ctx``, ``n_ctx``, and
    :meth:`embedding_and_head`. The runtime sets ``_lib``, ``_ctx``, ``options``, ``info``."""

    head_name: ClassVar[str]  # "EAGLE-3", "DFlash": how errors name the runtime
    _lib: Any
    _ctx: int | None
    options: BackendOptions
    info: DraftModelInfo

    def open_context(self, cfg: nl.Config, base: int | None, path: str) -> None:
        """Make the context (over the native target's ``base`` when there is one) and its sequence pool."""
        ctx = (self._lib.sk_ctx_new_over(ctypes.byref(cfg), base) if base is not None
               else self._lib.sk_ctx_new(ctypes.byref(cfg), nl.env_kernel_cap()))
        if not ctx:
            raise ConfigError(f"cannot create the native {self.head_name} runtime of {path} (n_ctx "
                              f"{self.options.n_ctx}, {self.options.n_seq_max} sequences): out of memory or "
                              "threads, or shapes the kernels refuse")
        self._ctx = int(ctx)
        self._seqs = SlotPool(self.options.n_seq_max, self._reserve_kv, self._release_kv, what="draft sequence")

    def close(self) -> None:
        """Free the context (it lets go of the target's it was made over)."""
        if getattr(self, "_ctx", None):
            self._lib.sk_ctx_free(self._ctx)
        self._ctx = None

    def __del__(self) -> None:
        self.close()

    def _live(self) -> int:
        if not self._ctx:
            raise ConfigError(f"the native {self.head_name} runtime is closed")
        return self._ctx

    # --- sequences (new_seq, free_seq, seq_len, truncate: PooledSeqs over KV slots) --------------
    @property
    def n_ctx(self) -> int:
        return self.options.n_ctx

    def _reserve_kv(self, slot: int) -> None:
        if self._lib.sk_kv_alloc(self._live(), slot) != 0:
            raise ConfigError(f"cannot reserve the {self.head_name} head's KV cache of one sequence for --ctx-size "
                              f"{self.options.n_ctx}; use a smaller --ctx-size")

    def _release_kv(self, slot: int) -> None:
        if self._ctx:
            self._lib.sk_kv_release(self._ctx, slot)

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """The kernels' own context shift over the head's cache (its layers' keys re-roped by -n_discard
        from the stored float16 with the head's rope pairing and rounded once, as the target's shift does)."""
        seq = self._seqs.get(seq_id)
        check_shift(n_keep, n_discard, seq.length)
        if self._lib.sk_kv_shift(self._live(), seq.slot, n_keep, n_discard, seq.length) != 0:
            raise MemoryError(f"native {self.head_name} context shift of draft sequence {seq_id}: out of memory")
        seq.length -= n_discard

    def check_write(self, seq_id: int, start: int, n: int) -> None:
        """Rows at positions start .. start + n - 1 of a sequence: no gap after what it holds, within n_ctx."""
        have = self.seq_len(seq_id)
        if start > have:
            raise ConfigError(f"draft sequence {seq_id}: write at {start} leaves a gap after {have}")
        if start + n > self.n_ctx:
            raise ContextOverflowError(f"draft sequence {seq_id}: position {start + n - 1} exceeds n_ctx {self.n_ctx}")

    # --- output vocabulary and borrowed tensors ------------------------------------------------------
    def draft_vocabulary(self, f: GGUFFile) -> np.ndarray:
        """The file's d2t: the target id of each row of its own reduced head, checked to be distinct ids
        within the target's vocabulary."""
        d2t = np.asarray(f.tensor("d2t").data, dtype=np.int64).copy()
        n_vocab = self.info.n_vocab
        if d2t.size and (d2t.min() < 0 or d2t.max() >= n_vocab or np.unique(d2t).size != d2t.size):
            raise ModelFileError(f.path, f"d2t must map draft ids to distinct target ids in [0, {n_vocab})")
        return d2t

    def embedding_and_head(self, w: NativeWeights, target: ModelInfo, base: int | None, *,
                           tied: bool) -> tuple[nl.Tensor, nl.Tensor, bool]:
        """(token embedding, output head, whether the head is the draft's own ``output``): the draft's own
        tensors, else the target's, as the native target prepared them when this context runs over it
        (a prepared head is in the kernels' layout), else read from the target's file. With ``tied`` a
        draft with its own token_embd and no output uses that embedding as its head (DFlash, as
        llama.cpp reads it); otherwise a draft without an output borrows the target's."""
        f, V, H = w.f, self.info.n_vocab, self.info.n_embd
        own_embd = w.matrix("token_embd.weight", shape=(V, H)) if f.has_tensor("token_embd.weight") else None
        own_head = w.matrix("output.weight") if f.has_tensor("output.weight") else None
        if own_embd is not None and (own_head is not None or tied):
            return own_embd, own_head if own_head is not None else own_embd, own_head is not None
        if base is not None:
            tcfg = nl.ctx_config(base)
            t_embd, t_head = tcfg.token_embd, tcfg.output
        else:
            tf = GGUFFile.shared(target.path)
            self._target_weights = tw = NativeWeights(tf, None)  # keeps the target's mapped arrays alive
            t_embd = tw.matrix("token_embd.weight")
            t_head = tw.matrix("output.weight" if tf.has_tensor("output.weight") else "token_embd.weight")
        embd = own_embd if own_embd is not None else t_embd
        if embd.n_rows != V or embd.n_cols != H:
            raise ModelFileError(f.path, f"token embeddings ({embd.n_rows}, {embd.n_cols}) do not fit ({V}, {H})")
        return embd, own_head if own_head is not None else t_head, own_head is not None
