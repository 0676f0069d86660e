"""Native CPU backend: spekula's own C kernels reading the GGUF blocks in place.

The file is memory-mapped and the matmuls read its quantized blocks directly (F32, F16, BF16, Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4): no float copy of any matmul
weight exists, so memory is about the file's size plus the KV cache (up to 2.7 times the file's bytes for
the types the SIMD kernels repack into a wider one's layout: docs/backends.md). Activations entering a quantized matmul are quantized to
int8 per 32 values, as llama.cpp does, so logits differ from the float32 dequantized reference by
that rounding (tests state the tolerance).

Always exact in the project's sense: every output element is computed by one fixed instruction
sequence whatever the batch, the chunking or the thread count (see backends/native/csrc/sk.h), so a row's
logits are bitwise the same alone or inside any verification batch. The KV cache is float16.

The blocks are built from the model's description (gguf/architecture.py; native/blocks.py maps it to
the C structures). Hybrid models (Qwen3.5) run gated delta-net blocks (backends/native/csrc/sk_deltanet.c)
whose per-sequence recurrent state lives beside the sequence's KV cache (attention blocks only); it
follows core/backend.py's contract: a checkpoint costs nothing, a truncate back to a length from the
checkpoint on replays the logged rows after it through the recurrence alone (bitwise the forward's
state), and snapshots are copies. Sliding-window blocks (Gemma 3) keep their keys and values in a ring of
the window plus ``swa_row_cap`` rows per sequence (backends/native/csrc/sk_swa.h): a forward adds at most
that many rows to a sequence (longer inputs run in rounds, backends/row_rounds.py; so does a forward of more
than ``FORWARD_ROW_CAP`` rows in all, but a hybrid model's), and a truncate may go
back to any length whose window is still in the ring, to a snapshot (a copy of the window, taken once a
forward would overwrite it: two per sequence), or to 0 (``restorable``); anything else is refused. Mixture-of-experts blocks describe each expert as a view of its slice of the 3-D
expert tensor (native/moe.py); the C side runs them as grouped matmuls (backends/native/csrc/sk_moe.c).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import numpy as np

from spekula.backends.context_shift import check_shift, shift_refusal
from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.classifier import read_classifier_head
from spekula.backends.gguf.recipes import FEATURES
from spekula.backends.gguf.weights import rope_inv_freq
from spekula.backends.native import lib as nl
from spekula.backends.native.blocks import build_layer, model_config, per_layer_input_fields
from spekula.backends.native.weights import NativeWeights
from spekula.backends.row_rounds import forward_in_rounds, needs_rounds
from spekula.backends.seq_inputs import check_inputs
from spekula.backends.seq_slots import PooledSeqs, SlotPool
from spekula.backends.seq_state import ExpectedArrays, check_state_arrays
from spekula.core.backend import Backend, BackendOptions, Capture, ModelInfo, SeqInput, SeqOutput, SeqState
from spekula.core.embedding import ClassifierHead
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile

_NO_CAPTURE = Capture()
# Bounds of the C structures' 32-bit fields, with room for positions and counts computed from them.
MAX_CTX = 1 << 26
MAX_SEQS = 4096
MAX_THREADS = 1024
# The most rows one forward adds to a sequence of a model with sliding-window blocks: their rings keep
# the window plus this many rows, so a rollback of up to this many rows (a rejected draft) stays exact.
SWA_ROW_CAP = 512
# The most rows of one C forward of a model without recurrent blocks: the kernels' scratch is sized by a
# forward's rows (~27 KB a row on Gemma 3 270M, ~120 KB on Ministral 3), and a longer input runs in
# rounds of this many, which give the same bits (batch invariance). 256 rows keep prompt speed (within
# 3 % of 512 on Ministral 3 IQ4_XS; 128 cost 7 %: bench/RESULTS.md, #47); a recurrent model's rollback
# snapshots are per forward, so its forwards are not cut.
FORWARD_ROW_CAP = 256


def check_head_options(options: BackendOptions, what: str) -> None:
    """A native head runtime (`what`: "MTP", "EAGLE-3") runs on the CPU in the GGUF's own block types,
    within the kernels' limits; anything else is a ConfigError naming the torch runtime."""
    if options.device.strip().lower() != "cpu" or options.dtype not in ("auto", "native"):
        raise ConfigError(f"the native {what} runtime runs on the CPU in the GGUF's own block types (got --device "
                          f"{options.device}, --dtype {options.dtype}); the torch runtime takes other devices and dtypes")
    if not 0 < options.n_ctx <= MAX_CTX or not 0 < options.n_seq_max <= MAX_SEQS or options.threads > MAX_THREADS:
        raise ConfigError(f"the native {what} runtime supports --ctx-size 1..{MAX_CTX}, 1..{MAX_SEQS} sequences and "
                          f"up to {MAX_THREADS} threads (got {options.n_ctx}, {options.n_seq_max}, {options.threads})")


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class NativeBackend(PooledSeqs, Backend):
    def __init__(self, model_path: str, options: BackendOptions) -> None:
        self.options = options
        if options.device.strip().lower() != "cpu":
            raise ConfigError(f"the native backend runs on the CPU only (got --device {options.device}); "
                              "use --backend torch for CUDA")
        if options.dtype not in ("auto", "native"):
            raise ConfigError(f"the native backend computes on the GGUF's own block types (got --dtype {options.dtype});"
                              " use --backend torch for f32/f16/bf16 or --backend onnx for q4")
        if options.n_ctx <= 0 or options.n_seq_max <= 0:
            raise ConfigError(f"n_ctx and n_seq_max must be positive (got {options.n_ctx}, {options.n_seq_max})")
        if options.n_ctx > MAX_CTX or options.n_seq_max > MAX_SEQS or options.threads > MAX_THREADS:
            raise ConfigError(f"the native backend supports --ctx-size up to {MAX_CTX}, up to {MAX_SEQS} sequences "
                              f"and {MAX_THREADS} threads (got {options.n_ctx}, {options.n_seq_max}, {options.threads})")
        f = GGUFFile.shared(model_path)
        # every operation of FEATURES: gated delta-net blocks, gated attention, the gated shared expert, Gemma 4's blocks
        hp = self.hparams = read_hparams(f, implements=FEATURES, runtime="the native backend")
        self.info = ModelInfo(path=str(model_path), arch=hp.arch, name=str(f.get("general.name", f.path.stem)),
                              n_vocab=hp.n_vocab, n_embd=hp.n_embd, n_layer=hp.n_layer, n_ctx_train=hp.n_ctx_train,
                              recurrent=hp.is_hybrid)
        self.sliding = any(hp.swa_layers)  # sliding blocks: bounded rings, so not every length is restorable
        self.swa_row_cap = SWA_ROW_CAP
        self.forward_row_cap: int | None = None if hp.is_hybrid else FORWARD_ROW_CAP
        self._file = f
        w = self._weights = NativeWeights(f, hp)
        self._layers = (nl.Layer * hp.n_layer)(*[build_layer(w, i) for i in range(hp.n_layer)])
        rope_freqs = w.vector("rope_freqs.weight", required=False)
        inv = np.ascontiguousarray(rope_inv_freq(hp, {} if rope_freqs is None else {"rope_freqs.weight": rope_freqs}),
                                   dtype=np.float64)
        inv_swa = None
        if self.sliding:
            inv_swa = np.ascontiguousarray(rope_inv_freq(hp, {} if rope_freqs is None else {"rope_freqs.weight": rope_freqs},
                                                         sliding=True), dtype=np.float64)
            w.keep.append(inv_swa)
        w.keep.append(inv)
        embd = w.matrix("token_embd.weight")
        # A tied head is the embedding matrix again (its own descriptor, which may carry output.bias).
        head = "output.weight" if f.has_tensor("output.weight") else "token_embd.weight"
        output = w.matrix(head, "output.bias")
        self.threads = options.threads if options.threads > 0 else default_threads()
        cfg = model_config(
            hp, n_layer=hp.n_layer, n_ff=hp.n_ff, n_ctx=options.n_ctx, n_seq_max=options.n_seq_max,
            n_threads=self.threads, rope_inv_freq=nl.ptr(inv), output_norm=nl.ptr(w.vector("output_norm.weight")),
            token_embd=embd, output=output, layers=self._layers, rope_inv_freq_swa=nl.ptr(inv_swa),
            swa_row_cap=self.swa_row_cap if self.sliding else 0, **per_layer_input_fields(w))
        self._cfg = cfg
        self._lib = nl.lib()
        if options.on_setup_done is not None:
            options.on_setup_done()
        if options.before_head is None:
            self._ctx = self._lib.sk_ctx_new(ctypes.byref(cfg), nl.env_kernel_cap())
        else:  # the output head, often the largest weight, packed once the caller's own peak is past
            self._ctx = self._lib.sk_ctx_new_head_later(ctypes.byref(cfg), nl.env_kernel_cap())
            if self._ctx:
                try:
                    options.before_head()
                except BaseException:
                    self._lib.sk_ctx_free(self._ctx)
                    self._ctx = None
                    raise
                self._lib.sk_ctx_pack_head(self._ctx)
        if not self._ctx:
            raise ConfigError(f"cannot create the native runtime ({self.threads} threads, n_ctx {options.n_ctx}, "
                              f"{options.n_seq_max} sequences): out of memory or threads")
        self.kernels = self._lib.sk_ctx_kernel_name(self._ctx).decode()
        self._rows = np.zeros((4, 64), np.int32)
        self._rows_ptr = self._rows.ctypes.data
        self._seqs = SlotPool(options.n_seq_max, self._reserve_kv, self._release_kv)

    @property
    def context(self) -> int | None:
        """The C context (None once closed), for contexts made over it (native/mtp.py: the MTP heads run
        on its threads with its prepared embedding and output head)."""
        return self._ctx

    # ---- sequences (new_seq, free_seq, seq_len, truncate: PooledSeqs over KV slots) ----------------

    def _reserve_kv(self, slot: int) -> None:
        if self._lib.sk_kv_alloc(self._ctx, slot) != 0:
            hp = self.hparams
            # delta-net blocks keep no KV; Gemma 4's blocks have their own KV heads and head sizes
            heads = sum(hp.block_n_head_kv(i) * hp.block_head_dim(i) for i in range(hp.n_layer)
                        if not hp.is_recurrent(i) and hp.layout.owns_kv(i))
            gib = heads * 2 * 2 * self.options.n_ctx / 2**30
            raise ConfigError(f"cannot reserve the KV cache of one sequence ({gib:.1f} GiB for --ctx-size "
                              f"{self.options.n_ctx}); use a smaller --ctx-size")

    def _release_kv(self, slot: int) -> None:
        self._lib.sk_kv_release(self._ctx, slot)

    def kv_slot(self, seq_id: int) -> int:
        """The C context's KV slot of a sequence (native/gemma4_assistant.py reads its keys there)."""
        return self._seqs.get(seq_id).slot

    def classifier_head(self) -> ClassifierHead | None:
        return read_classifier_head(self.info.path)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._lib.sk_ctx_free(self._ctx)
            self._ctx = None
            self._seqs.clear()

    def __del__(self) -> None:
        self.close()

    # ---- the recurrent state of hybrid models (core/backend.py's contract; sk_deltanet.h) -------------

    def checkpoint(self, seq_id: int) -> None:
        if self.info.recurrent and self._lib.sk_rs_checkpoint(self._ctx, self._seqs.get(seq_id).slot) != 0:
            raise MemoryError(f"native checkpoint of sequence {seq_id}: out of memory for its row log")

    def snapshot(self, seq_id: int) -> None:
        seq = self._seqs.get(seq_id)
        if self.info.recurrent and self._lib.sk_rs_snapshot(self._ctx, seq.slot) != 0:
            raise MemoryError(f"native snapshot of sequence {seq_id}: out of memory for the state's copy")
        if self.sliding and self._lib.sk_swa_snapshot(self._ctx, seq.slot, seq.length) == -1:
            raise MemoryError(f"native snapshot of sequence {seq_id}: out of memory for the window's copy")

    def _in_rings(self, slot: int, n: int) -> bool:
        """Whether the sliding blocks' rings still hold the window before length n (always for 0)."""
        return n == 0 or max(0, n - self.hparams.sliding_window + 1) >= int(self._lib.sk_swa_floor(self._ctx, slot))

    def restorable(self, seq_id: int, n_keep: int) -> int:
        seq = self._seqs.get(seq_id)
        n = max(0, min(int(n_keep), seq.length))
        if self.sliding:  # the window before n in the rings, else the longest snapshot below, else 0
            return n if self._in_rings(seq.slot, n) else max(0, int(self._lib.sk_swa_snapshot_at(self._ctx, seq.slot, n)))
        return int(self._lib.sk_rs_restorable(self._ctx, seq.slot, n)) if self.info.recurrent else n

    def truncate(self, seq_id: int, n_keep: int) -> None:
        seq = self._seqs.get(seq_id)
        n = max(0, min(int(n_keep), seq.length))
        if self.sliding:
            if self._in_rings(seq.slot, n):
                self._lib.sk_swa_truncate(self._ctx, seq.slot, n)
            elif self._lib.sk_swa_restore(self._ctx, seq.slot, n) != 0:
                raise ConfigError(f"truncate to {n}: sequence {seq_id} (at {seq.length}) keeps only the last "
                                  f"{self.hparams.sliding_window} positions and {self.swa_row_cap} rows more in its "
                                  f"sliding-window blocks and has no snapshot there; the longest restorable length "
                                  f"below is {self.restorable(seq_id, n)}")
        if self.info.recurrent and n != seq.length:
            rc = self._lib.sk_rs_truncate(self._ctx, seq.slot, n)
            if rc == -1:
                raise MemoryError(f"native truncate of sequence {seq_id}: out of memory for the replay")
            if rc != 0:
                raise ConfigError(f"truncate to {n}: sequence {seq_id} of a recurrent model cannot go back there (it is "
                                  f"at {seq.length}; the longest restorable length below is {self.restorable(seq_id, n)})")
        seq.length = n

    def context_shift_refusal(self) -> str | None:
        return shift_refusal(self.hparams, "the native backend")

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        refusal = self.context_shift_refusal()
        if refusal is not None:
            raise ConfigError(refusal)
        seq = self._seqs.get(seq_id)
        check_shift(n_keep, n_discard, seq.length)
        if self._lib.sk_kv_shift(self._ctx, seq.slot, n_keep, n_discard, seq.length) != 0:
            raise MemoryError(f"native context shift of sequence {seq_id}: out of memory for its row buffers")
        seq.length -= n_discard

    def recurrent_state(self, seq_id: int, layer: int) -> np.ndarray:
        """A copy of delta-net block `layer`'s state of the sequence: [S (n_v_heads x head_v_dim x
        head_k_dim) | conv rows ((conv_kernel - 1) x conv_dim)] flattened (tests compare it bitwise)."""
        dn = self.hparams.delta_net
        if dn is None or not dn.is_recurrent(layer):
            raise ConfigError(f"block {layer} keeps no recurrent state")
        out = np.empty(dn.state_floats, np.float32)
        if self._lib.sk_rs_read(self._ctx, self._seqs.get(seq_id).slot, layer, out.ctypes.data, out.size) < 0:
            raise ConfigError(f"no recurrent state for sequence {seq_id}")
        return out

    # ---- a sequence's state in and out (slot files; core/backend.py) --------------------------------

    @property
    def seq_state_format(self) -> str:
        return "native: f16 KV rows in the kernels' layout" + (", f32 delta-net state" if self.info.recurrent else "") + (
            ", sliding rings" if self.sliding else "")

    def _expected_state(self, n: int) -> ExpectedArrays:
        out = {"kv": (np.dtype(np.uint16), (int(self._lib.sk_kv_state_elems(self._ctx, n)),))}
        if self.info.recurrent:
            out["recurrent"] = (np.dtype(np.float32), (int(self._lib.sk_rs_state_floats(self._ctx)),))
        if self.sliding:
            out["swa_floor"] = (np.dtype(np.int64), (1,))
        return out

    def export_seq(self, seq_id: int) -> SeqState:
        if not self._ctx:
            raise ConfigError("the native backend is closed")
        seq = self._seqs.get(seq_id)
        shapes = self._expected_state(seq.length)
        arrays = {name: np.empty(shape, dtype) for name, (dtype, shape) in shapes.items()}
        kv = arrays["kv"]
        if self._lib.sk_kv_copy(self._ctx, seq.slot, seq.length, kv.ctypes.data, kv.size, 1) != kv.size:
            raise ConfigError(f"cannot read the KV cache of sequence {seq_id}")
        if self.info.recurrent:
            rec = arrays["recurrent"]
            if self._lib.sk_rs_export(self._ctx, seq.slot, rec.ctypes.data, rec.size) != rec.size:
                raise MemoryError(f"cannot read the recurrent state of sequence {seq_id}: out of memory for its replay")
        if self.sliding:
            arrays["swa_floor"][0] = int(self._lib.sk_swa_floor(self._ctx, seq.slot))
        return SeqState(seq.length, arrays)

    def import_seq(self, seq_id: int, state: SeqState) -> None:
        if not self._ctx:
            raise ConfigError("the native backend is closed")
        seq = self._seqs.get(seq_id)
        n = int(state.length)
        if not 0 <= n <= self.options.n_ctx:
            raise ConfigError(f"a state of {n} positions does not fit a context of {self.options.n_ctx}")
        check_state_arrays(state, self._expected_state(n))
        if self.sliding and not 0 <= int(state.arrays["swa_floor"][0]) <= n:
            raise ConfigError(f"the state's ring floor {int(state.arrays['swa_floor'][0])} is outside [0, {n}]")
        kv = np.ascontiguousarray(state.arrays["kv"])
        if self._lib.sk_kv_copy(self._ctx, seq.slot, n, kv.ctypes.data, kv.size, 0) != kv.size:
            raise ConfigError(f"cannot write the KV cache of sequence {seq_id}")
        if self.info.recurrent:
            rec = np.ascontiguousarray(state.arrays["recurrent"])
            if self._lib.sk_rs_import(self._ctx, seq.slot, rec.ctypes.data, rec.size, n) != 0:
                raise ConfigError(f"cannot write the recurrent state of sequence {seq_id}")
        if self.sliding:
            self._lib.sk_swa_reset_slot(self._ctx, seq.slot, int(state.arrays["swa_floor"][0]))
        seq.length = n

    # ---- forward -----------------------------------------------------------------------------------

    def _row_buffers(self, m: int) -> np.ndarray:
        """int32 [4, >= m]: tokens, positions, KV slots and logit rows of a forward (kept between calls,
        with their address: a decode step's bookkeeping is a measurable part of its time)."""
        if self._rows.shape[1] < m:
            self._rows = np.zeros((4, max(m, 2 * self._rows.shape[1])), np.int32)
            self._rows_ptr = self._rows.ctypes.data
        return self._rows

    def forward(self, inputs: Sequence[SeqInput], capture: Capture = _NO_CAPTURE) -> list[SeqOutput]:
        if not self._ctx:
            raise ConfigError("the native backend is closed")
        hp = self.hparams
        checked = check_inputs(inputs, capture, n_layer=hp.n_layer, n_vocab=hp.n_vocab, n_ctx=self.options.n_ctx,
                               seq_len=self.seq_len)
        if self.info.recurrent or self.sliding:  # a recurrent state or a ring: go back first (or refuse)
            for c in checked:
                if c.start != self.seq_len(c.seq_id):
                    self.truncate(c.seq_id, c.start)
        seq_cap = self.swa_row_cap if self.sliding else self.options.n_ctx
        if needs_rounds(checked, seq_cap, self.forward_row_cap):
            return forward_in_rounds(self.forward, checked, capture, seq_cap, hp.n_vocab, self.forward_row_cap)
        m = sum(int(c.tokens.size) for c in checked)
        if m == 0:
            return [SeqOutput(logits=np.empty((c.logit_rows.size, hp.n_vocab), np.float32)) for c in checked]
        rows = self._row_buffers(m)
        wanted, offsets, o, ordered = [], [], 0, True
        for c in checked:
            n = int(c.tokens.size)
            if n == 1:  # a decode step: scalars, not one-element arrays
                rows[0, o] = c.tokens[0]
                rows[1, o] = c.start
            else:
                rows[0, o : o + n] = c.tokens
                rows[1, o : o + n] = np.arange(c.start, c.start + n, dtype=np.int32)
            rows[2, o : o + n] = self._seqs.get(c.seq_id).slot
            lr = c.logit_rows
            ordered = ordered and (lr.size < 2 or bool(np.all(lr[1:] > lr[:-1])))
            wanted.append(lr + o if o else lr)
            offsets.append(o)
            o += n
        offsets.append(m)
        # Rows of each sequence strictly increasing (the scheduler's case): they are already the sorted
        # distinct rows the C side computes, and each sequence's logits are a view of one array.
        if ordered:
            out_rows = rows[3, : sum(int(w.size) for w in wanted)]  # at most m: distinct rows of the batch
            k = 0
            for w in wanted:
                out_rows[k : k + w.size] = w
                k += w.size
        else:
            out_rows = np.unique(np.concatenate(wanted)).astype(np.int32)
        logits = np.empty((out_rows.size, hp.n_vocab), np.float32)
        cap_arrays = {layer: np.empty((m, hp.n_embd), np.float32) for layer in sorted(capture.layers)}
        cap_ptrs = None
        if cap_arrays:
            cap_ptrs = (ctypes.c_void_p * (hp.n_layer + 1))(*[nl.ptr(cap_arrays.get(i)) for i in range(hp.n_layer + 1)])
        hidden = np.empty((m, hp.n_embd), np.float32) if capture.final_norm else None
        stride = rows.strides[0]
        base = self._rows_ptr
        out_ptr = (base + 3 * stride if ordered else out_rows.ctypes.data) if out_rows.size else None
        batch = nl.Batch(n_rows=m, tokens=base, pos=base + stride, seq=base + 2 * stride, n_out=out_rows.size,
                         out_rows=out_ptr, logits=logits.ctypes.data,
                         capture=ctypes.cast(cap_ptrs, ctypes.c_void_p) if cap_ptrs is not None else None,
                         hidden_final=nl.ptr(hidden))
        nl.forward(self._ctx, batch, "native forward")
        if hp.final_softcap:  # cap * tanh(logits / cap), elementwise: a row's bits stay its own
            np.multiply(np.tanh(np.divide(logits, hp.final_softcap, out=logits), out=logits), hp.final_softcap,
                        out=logits)
        outs, k = [], 0
        for i, c in enumerate(checked):
            self._seqs.get(c.seq_id).length = c.start + int(c.tokens.size)
            n_out = int(c.logit_rows.size)
            lg = logits[k : k + n_out] if ordered else logits[np.searchsorted(out_rows, wanted[i])]
            k += n_out
            out = SeqOutput(logits=lg)
            o0, o1 = offsets[i], offsets[i + 1]
            for layer, arr in cap_arrays.items():
                out.layer_inputs[layer] = arr[o0:o1]
            if hidden is not None:
                out.hidden_final = hidden[o0:o1]
            outs.append(out)
        return outs


backend_class = NativeBackend
