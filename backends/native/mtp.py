"""Multi-token-prediction heads on spekula's native kernels: each head is a native context over its one block.

A head is a C context (backends/native/csrc/sk_ctx.c) whose config lists the head's block (``blk.{N + k}``,
built by the native backend's own layer code: attention (gated for Qwen3.5), the dense FFN or the MoE
FFN with its shared expert, norms, rope, float16 KV cache) and an input projection: its rows enter as
``eh_proj . [rmsnorm(E[x], enorm); rmsnorm(h, hnorm)]`` instead of ``E[x]``, and its output norm and
head are the head's ``shared_head_norm`` / ``shared_head_head`` or the trunk's ``output_norm`` /
``output``. The C forward then returns hout (its ``hidden_final``) and the logits, quantizing
activations to int8 before quantized matmuls as the target does, and bitwise independent of
batching, chunking and threads like every native forward.

Nothing is loaded twice. The heads' contexts are made over the target's (``sk_ctx_new_over``): they
run on its thread pool and, when the heads are read from the target's own file, use the target's
embedding and its output head as the target prepared them (repacked once at the target's load); a
head falling back to a tensor an earlier head prepared (an MTP-only ``-md`` file's ``output``) takes
that one (so do Qwen3.5 heads sharing the first MTP block's ``eh_proj``). Only the heads' own blocks,
``eh_proj`` and the tensors a head has of its own are prepared here (the small norm vectors are read
again). Each context keeps the one it was made over alive, so
closing the target first is safe. Without a native target (the runtime built on its own) head 0
starts its own thread pool.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from spekula.backends.context_shift import check_shift, shift_refusal
from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.moe import head_sources, nextn_shapes
from spekula.backends.gguf.recipes import FEATURES
from spekula.backends.gguf.weights import block_shapes, rope_inv_freq
from spekula.backends.native import lib as nl
from spekula.backends.native.backend import NativeBackend, check_head_options, default_threads
from spekula.backends.native.blocks import build_layer, model_config
from spekula.backends.native.weights import NativeWeights
from spekula.backends.seq_slots import PooledSeqs, SlotPool
from spekula.core.backend import Backend, BackendOptions
from spekula.core.drafting.mtp_runtime import MtpInfo, MtpOut, MtpRows, MtpRuntime, decode_by_head
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile


class NativeMtpRuntime(PooledSeqs, MtpRuntime):
    def __init__(self, f: GGUFFile, info: MtpInfo, target: Backend, options: BackendOptions) -> None:
        check_head_options(options, "MTP")
        self.info, self.options = info, options
        # every operation of FEATURES, as the native backend: gated attention, the gated shared expert
        hp = self.hp = read_hparams(f, implements=FEATURES, runtime="the native MTP runtime")
        if hp.n_nextn != info.n_heads:
            raise ModelFileError(f.path, f"{hp.arch} MTP heads need nextn_predict_layers = {info.n_heads}")
        self._lib = nl.lib()
        self._file = f  # the mapped file every unpacked descriptor points into
        self._ctxs: list[int] = []
        w = self._weights = NativeWeights(f, hp)
        for head in range(info.n_heads):
            required, optional = nextn_shapes(f"blk.{info.nextn_block(head)}.", hp.n_embd, hp.n_vocab)
            w.shapes |= block_shapes(hp, info.block(head)) | required | optional
        rope_freqs = w.vector("rope_freqs.weight", required=False)
        self._inv = np.ascontiguousarray(
            rope_inv_freq(hp, {} if rope_freqs is None else {"rope_freqs.weight": rope_freqs}), dtype=np.float64)
        base = target.context if isinstance(target, NativeBackend) else None
        # (role, tensor name) -> a descriptor some context already prepared: an embedding is looked up
        # row by row in the file's layout, a head is a matmul weight in the kernels' layout.
        prepared: dict[tuple[str, str], nl.Tensor] = {}
        if base is not None and GGUFFile.shared(target.info.path) is f:
            tcfg = nl.ctx_config(base)
            prepared[("embd", "token_embd.weight")] = tcfg.token_embd
            if not f.has_tensor("output.bias"):  # the target's head carries output.bias, the heads' none
                prepared[("head", "token_embd.weight" if hp.tied_output else "output.weight")] = tcfg.output
        self.threads = 0 if base is not None else (options.threads if options.threads > 0 else default_threads())
        try:
            for head in range(info.n_heads):
                base = self._new_head(w, info.block(head), info.nextn_block(head), prepared, base)
        except BaseException:
            self.close()
            raise
        self._seqs = SlotPool(options.n_seq_max, self._reserve_kv, self._release_kv, what="MTP sequence")

    def _new_head(self, w: NativeWeights, block: int, nextn_block: int, prepared: dict[tuple[str, str], nl.Tensor],
                  base: int | None) -> int:
        """The context of the head over `block` (its nextn.* tensors in `nextn_block`), made over `base` (None:
        its own threads); what it prepared goes to `prepared`."""
        hp, H, V = self.hp, self.hp.n_embd, self.hp.n_vocab
        src, b = head_sources(w.f, hp.tied_output, nextn_block), f"blk.{nextn_block}.nextn."
        embd = prepared.get(("embd", src.embd))
        head = prepared.get(("head", src.head))
        in_proj = prepared.get(("in_proj", b + "eh_proj.weight"))
        if embd is None:
            embd = w.matrix(src.embd, shape=(V, H))
        if head is None:
            head = w.matrix(src.head, shape=(V, H))
        if in_proj is None:
            in_proj = w.matrix(b + "eh_proj.weight")
        layers = (nl.Layer * 1)(build_layer(w, block))
        w.structs.append(layers)
        cfg = model_config(
            hp, n_layer=1, n_ff=0 if hp.moe is not None and hp.moe.is_moe(block) else hp.n_ff,
            n_ctx=self.options.n_ctx, n_seq_max=self.options.n_seq_max, n_threads=self.threads,
            rope_inv_freq=nl.ptr(self._inv),
            output_norm=nl.ptr(w.vector(src.norm)), token_embd=embd, output=head, layers=layers,
            in_proj=in_proj, in_embd_norm=nl.ptr(w.vector(b + "enorm.weight")),
            in_hidden_norm=nl.ptr(w.vector(b + "hnorm.weight")))
        if base is not None:
            ctx = self._lib.sk_ctx_new_over(ctypes.byref(cfg), base)
        else:
            ctx = self._lib.sk_ctx_new(ctypes.byref(cfg), nl.env_kernel_cap())
        if not ctx:
            raise ConfigError(f"cannot create the native runtime of MTP block {block} of {w.f.path} (n_ctx "
                              f"{self.options.n_ctx}, {self.options.n_seq_max} sequences): out of memory or threads")
        self._ctxs.append(ctx)
        ran = nl.ctx_config(ctx)
        prepared.setdefault(("embd", src.embd), ran.token_embd)
        prepared.setdefault(("head", src.head), ran.output)
        prepared.setdefault(("in_proj", b + "eh_proj.weight"), ran.in_proj)
        return int(ctx)

    def close(self) -> None:
        """Free the heads' contexts (each lets go of the one it was made over)."""
        for ctx in reversed(getattr(self, "_ctxs", [])):
            self._lib.sk_ctx_free(ctx)
        self._ctxs = []

    def __del__(self) -> None:
        self.close()

    @property
    def contexts(self) -> list[int]:
        """The heads' C contexts, head 0 first (tests compare what they were given)."""
        return list(self._ctxs)

    # --- sequences (new_seq, free_seq, seq_len, truncate: PooledSeqs over KV slots) --------------
    @property
    def n_ctx(self) -> int:
        return self.options.n_ctx

    def _reserve_kv(self, slot: int) -> None:
        """Slot `slot`'s cache in every head (the same slot in each), or none of them."""
        for k, ctx in enumerate(self._ctxs):
            if self._lib.sk_kv_alloc(ctx, slot) != 0:
                for done in self._ctxs[:k]:
                    self._lib.sk_kv_release(done, slot)
                raise ConfigError(f"cannot reserve the MTP heads' KV cache of one sequence for --ctx-size "
                                  f"{self.options.n_ctx}; use a smaller --ctx-size")

    def _release_kv(self, slot: int) -> None:
        for ctx in self._ctxs:
            self._lib.sk_kv_release(ctx, slot)

    def shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Every head's cache shifts with the kernels' own context shift (as the target's does)."""
        refusal = shift_refusal(self.hp, "the native MTP runtime")
        if refusal is not None:
            raise ConfigError(refusal)
        seq = self._seqs.get(seq_id)
        check_shift(n_keep, n_discard, seq.length)
        for ctx in self._ctxs:
            if self._lib.sk_kv_shift(ctx, seq.slot, n_keep, n_discard, seq.length) != 0:
                raise MemoryError(f"native context shift of MTP sequence {seq_id}: out of memory for its row buffers")
        seq.length -= n_discard

    # --- decoding --------------------------------------------------------------------------------
    def decode(self, rows: Sequence[MtpRows]) -> list[MtpOut]:
        if not self._ctxs:
            raise ConfigError("the native MTP runtime is closed")
        return decode_by_head(rows, self.info, self._decode_head, seq_len=self.seq_len, n_ctx=self.n_ctx)

    def _decode_head(self, head: int, rows: list[MtpRows]) -> list[MtpOut]:
        """One native forward of head `head` over every sequence's rows."""
        H = self.info.n_embd
        sizes = [len(r.tokens) for r in rows]
        m = sum(sizes)
        tokens = np.concatenate([np.asarray(r.tokens, dtype=np.int32) for r in rows])
        pos = np.concatenate([np.arange(r.start, r.start + len(r.tokens), dtype=np.int32) for r in rows])
        seq = np.concatenate([np.full(len(r.tokens), self._seqs.get(r.seq_id).slot, np.int32) for r in rows])
        hidden_in = np.ascontiguousarray(np.concatenate([np.asarray(r.hidden, dtype=np.float32) for r in rows]))
        ends = np.cumsum(sizes) - 1
        out_rows = np.array([ends[k] for k, r in enumerate(rows) if r.want_last], dtype=np.int32)
        logits = np.empty((out_rows.size, self.hp.n_vocab), np.float32)
        hout = np.empty((m, H), np.float32) if out_rows.size else None
        batch = nl.Batch(n_rows=m, tokens=nl.ptr(tokens), pos=nl.ptr(pos), seq=nl.ptr(seq), n_out=out_rows.size,
                         out_rows=nl.ptr(out_rows) if out_rows.size else None, logits=nl.ptr(logits), capture=None,
                         hidden_final=nl.ptr(hout), hidden_in=nl.ptr(hidden_in))
        nl.forward(self._ctxs[head], batch, "native MTP forward")
        for r in rows:
            self._seqs.get(r.seq_id).length = r.start + len(r.tokens)
        outs, k = [], 0
        for j, r in enumerate(rows):
            if r.want_last and hout is not None:
                outs.append(MtpOut(logits[k], hout[ends[j]]))
                k += 1
            else:
                outs.append(MtpOut(None, None))
        return outs


runtime_class = NativeMtpRuntime
