"""EAGLE-3 draft heads on spekula's native kernels: the head's one layer is a native context.

The head (docs/model-formats.md, "EAGLE-3") is an encoder ``fc`` over the target's three captured
layers and one Llama layer whose q/k/v read ``[rmsnorm(E[token]); rmsnorm(g)]`` (twice the hidden
width) while its residual stream starts from ``g``. The C forward (backends/native/csrc/sk_model.c, "wide
input") runs that layer over the GGUF's own block types, quantizing activations to int8 before
quantized matmuls as the target does; ``fc`` is the context's encoder (``sk_project_in``), and the
reduced draft vocabulary's head is the context's output matrix, whose logits are spread over the
target's vocabulary here through ``d2t``.

The context is made over the native target's (``sk_ctx_new_over``): it runs on the target's thread
pool (no second pool spinning beside the target's) and takes the target's prepared embedding, and its
output head when the draft has none of its own. A draft only proposes, so its numerics need not match
the torch runtime's bit for bit; the target verifies every token either way.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import numpy as np

from spekula.backends.native import lib as nl
from spekula.backends.native.backend import NativeBackend, check_head_options, default_threads
from spekula.backends.native.head import NativeHeadContext
from spekula.backends.native.weights import NativeWeights
from spekula.core.backend import Backend, BackendOptions, ModelInfo
from spekula.core.drafting.draft_models import (
    DraftAttention,
    DraftModelInfo,
    Eagle3Out,
    Eagle3Rows,
    Eagle3Runtime,
    read_draft_attention,
)
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile


def rope_inverse_frequencies(f: GGUFFile, att: DraftAttention) -> np.ndarray:
    """theta_i(p) = p * inv[i]: base^(-2i/n_rot), linear scaling and the optional rope_freqs divisor folded in."""
    n_rot = att.n_rot
    inv = att.freq_scale * att.rope_base ** (-2.0 * np.arange(n_rot // 2, dtype=np.float64) / n_rot)
    if f.has_tensor("rope_freqs.weight"):
        inv = inv / np.asarray(f.tensor("rope_freqs.weight").data, dtype=np.float64).reshape(-1)
    return np.ascontiguousarray(inv)


class NativeEagle3Runtime(NativeHeadContext, Eagle3Runtime):
    head_name = "EAGLE-3"

    def __init__(self, f: GGUFFile, info: DraftModelInfo, target: ModelInfo, options: BackendOptions,
                 target_backend: Backend | None = None) -> None:
        check_head_options(options, "EAGLE-3")
        self.info, self.options = info, options
        self._lib = nl.lib()
        self._ctx: int | None = None
        a, H = "eagle3", info.n_embd
        if int(f.get(f"{a}.block_count", 1)) != 1:
            raise ModelFileError(f.path, "eagle3 drafts have exactly one decoder layer")
        att = read_draft_attention(f, a, H)
        n_head, n_head_kv, head_dim, n_rot = att.n_head, att.n_head_kv, att.head_dim, att.n_rot
        n_ff = int(f.require(f"{a}.feed_forward_length"))
        q_out, kv_out = n_head * head_dim, n_head_kv * head_dim
        w = self._weights = NativeWeights(f, None)
        self._enc_norm = w.vector("enc.output_norm.weight") if f.get(f"{a}.norm_before_fc", False) else None
        layer = nl.Layer()
        layer.ffn_norm = nl.ptr(w.vector("blk.0.ffn_norm.weight"))
        layer.wq = w.matrix("blk.0.attn_q.weight", shape=(q_out, 2 * H))
        layer.wk = w.matrix("blk.0.attn_k.weight", shape=(kv_out, 2 * H))
        layer.wv = w.matrix("blk.0.attn_v.weight", shape=(kv_out, 2 * H))
        layer.wo = w.matrix("blk.0.attn_output.weight", shape=(H, q_out))
        layer.w_gate = w.matrix("blk.0.ffn_gate.weight", shape=(n_ff, H))
        layer.w_up = w.matrix("blk.0.ffn_up.weight", shape=(n_ff, H))
        layer.w_down = w.matrix("blk.0.ffn_down.weight", shape=(H, n_ff))
        layers = (nl.Layer * 1)(layer)
        w.structs.append(layers)
        self._inv = rope_inverse_frequencies(f, att)
        self._rms_eps = att.eps

        base = target_backend.context if isinstance(target_backend, NativeBackend) else None
        embd, head, _ = self.embedding_and_head(w, target, base, tied=False)
        self.d2t: np.ndarray | None = None
        if f.has_tensor("output.weight") and f.has_tensor("d2t"):
            self.d2t = self.draft_vocabulary(f)
            if head.n_rows != self.d2t.shape[0]:
                raise ModelFileError(f.path, f"output rows {head.n_rows} != d2t entries {self.d2t.shape[0]}")
        if head.n_cols != H or (self.d2t is None and head.n_rows != info.n_vocab):
            raise ModelFileError(f.path, f"output head ({head.n_rows}, {head.n_cols}) does not fit the draft")
        self.n_out_vocab = int(head.n_rows)
        wide = nl.WIDE_RESIDUAL_NORMED if f.get(f"{a}.norm_before_residual", False) else nl.WIDE_RESIDUAL_HIDDEN
        cfg = nl.Config(
            n_vocab=info.n_vocab, n_embd=H, n_layer=1, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
            n_ff=n_ff, n_rot=n_rot, rope_neox=0, n_ctx=options.n_ctx, n_seq_max=options.n_seq_max,
            n_threads=0 if base is not None else (options.threads if options.threads > 0 else default_threads()),
            rms_eps=self._rms_eps, attn_scale=1.0 / math.sqrt(head_dim),
            rope_inv_freq=nl.ptr(self._inv), output_norm=nl.ptr(w.vector("output_norm.weight", required=True)),
            token_embd=embd, output=head, layers=layers,
            in_proj=w.matrix("fc.weight", shape=(H, 3 * info.target_hidden)),
            in_embd_norm=nl.ptr(w.vector("blk.0.attn_norm.weight")),
            in_hidden_norm=nl.ptr(w.vector("blk.0.attn_norm_2.weight")), wide_input=wide)
        self.open_context(cfg, base, str(f.path))
        self._one = _OneRowStep(H, self.n_out_vocab)

    # --- graphs ----------------------------------------------------------------------------------
    def encode(self, features: np.ndarray) -> np.ndarray:
        n_in = 3 * self.info.target_hidden
        x = np.ascontiguousarray(features, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != n_in:
            raise ValueError(f"eagle3 features must be [T, {n_in}], got {tuple(x.shape)}")
        out = np.empty((x.shape[0], self.info.n_embd), np.float32)
        if x.shape[0] == 0:
            return out
        if self._enc_norm is not None:
            x = x / np.sqrt(np.mean(np.square(x), axis=1, keepdims=True) + self._rms_eps) * self._enc_norm
            x = np.ascontiguousarray(x, dtype=np.float32)
        if self._lib.sk_project_in(self._live(), nl.ptr(x), x.shape[0], nl.ptr(out)) != 0:
            raise MemoryError(f"native EAGLE-3 encoder over {x.shape[0]} rows: out of memory for its scratch")
        return out

    def decode(self, rows: Sequence[Eagle3Rows]) -> list[Eagle3Out]:
        return self._decode(rows, step=False)

    def draft_step(self, rows: Sequence[Eagle3Rows]) -> list[Eagle3Out]:
        """Logits over the draft vocabulary (``vocab`` = d2t), not spread over the target's; one row of one
        sequence (the single-stream case after the first step) runs from preallocated buffers."""
        if len(rows) != 1 or len(rows[0].tokens) != 1:
            return self._decode(rows, step=True)
        r = rows[0]
        self._check(rows)
        if np.shape(r.hidden) != self._one.hidden.shape:
            raise ValueError(f"eagle3 hidden rows must be {list(self._one.hidden.shape)}, got {list(np.shape(r.hidden))}")
        one, entry = self._one, self._seqs.get(r.seq_id)
        one.token[0], one.pos[0], one.seq[0] = r.tokens[0], r.start, entry.slot
        one.hidden[...] = r.hidden
        nl.forward(self._live(), one.batch, "native EAGLE-3 forward")
        entry.length = r.start + 1
        return [Eagle3Out(one.logits, one.prenorm, self.d2t)]

    def _check(self, rows: Sequence[Eagle3Rows]) -> None:
        seen: set[int] = set()
        for r in rows:
            if r.seq_id in seen:
                raise ConfigError(f"draft sequence {r.seq_id} appears twice in one decode")
            seen.add(r.seq_id)
            self.check_write(r.seq_id, r.start, len(r.tokens))

    def _decode(self, rows: Sequence[Eagle3Rows], *, step: bool) -> list[Eagle3Out]:
        """decode(), or with ``step`` draft_step()'s answer: the last row of each entry, over the draft
        vocabulary."""
        if not rows:
            return []
        ctx, H = self._live(), self.info.n_embd
        self._check(rows)
        sizes = [len(r.tokens) for r in rows]
        m = int(sum(sizes))
        tokens = np.concatenate([np.asarray(r.tokens, dtype=np.int32) for r in rows])
        pos = np.concatenate([np.arange(r.start, r.start + len(r.tokens), dtype=np.int32) for r in rows])
        seq = np.concatenate([np.full(len(r.tokens), self._seqs.get(r.seq_id).slot, np.int32) for r in rows])
        hidden = np.ascontiguousarray(np.concatenate([np.asarray(r.hidden, dtype=np.float32) for r in rows]))
        if hidden.shape != (m, H):
            raise ValueError(f"eagle3 hidden rows must be [{m}, {H}], got {tuple(hidden.shape)}")
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        if step:
            out_rows = (offsets[1:] - 1).astype(np.int32)
        else:
            out_rows = np.concatenate([np.arange(offsets[k], offsets[k + 1], dtype=np.int32)
                                       for k, r in enumerate(rows) if r.want_logits] or [np.zeros(0, np.int32)])
        logits = np.empty((out_rows.size, self.n_out_vocab), np.float32)
        prenorm = np.empty((m, H), np.float32)
        capture = (ctypes.c_void_p * 2)(None, nl.ptr(prenorm))  # the residual after the block: pre-norm
        batch = nl.Batch(n_rows=m, tokens=nl.ptr(tokens), pos=nl.ptr(pos), seq=nl.ptr(seq), n_out=out_rows.size,
                         out_rows=nl.ptr(out_rows) if out_rows.size else None, logits=nl.ptr(logits),
                         capture=ctypes.cast(capture, ctypes.c_void_p), hidden_final=None, hidden_in=nl.ptr(hidden))
        nl.forward(ctx, batch, "native EAGLE-3 forward")
        for r in rows:
            self._seqs.get(r.seq_id).length = r.start + len(r.tokens)
        if step:
            return [Eagle3Out(logits[k:k + 1], prenorm[b - 1:b], self.d2t) for k, b in enumerate(offsets[1:])]
        full = logits
        if self.d2t is not None:  # draft-vocabulary rows spread over the target's, -inf elsewhere
            full = np.full((out_rows.size, self.info.n_vocab), -np.inf, np.float32)
            full[:, self.d2t] = logits
        outs: list[Eagle3Out] = []
        li = 0
        for k, r in enumerate(rows):
            a, b = int(offsets[k]), int(offsets[k + 1])
            rl = None
            if r.want_logits:
                rl = full[li:li + (b - a)]
                li += b - a
            outs.append(Eagle3Out(rl, prenorm[a:b]))
        return outs


class _OneRowStep:
    """Buffers and a ready batch for one row with logits: a draft step of a single sequence, the
    common case, without building arrays and taking their addresses at every step (which cost about
    half as much as the head's own forward)."""

    def __init__(self, n_embd: int, n_out_vocab: int) -> None:
        self.token = np.zeros(1, np.int32)
        self.pos = np.zeros(1, np.int32)
        self.seq = np.zeros(1, np.int32)
        self.hidden = np.zeros((1, n_embd), np.float32)
        self.out_rows = np.zeros(1, np.int32)
        self.logits = np.empty((1, n_out_vocab), np.float32)
        self.prenorm = np.empty((1, n_embd), np.float32)
        self._capture = (ctypes.c_void_p * 2)(None, nl.ptr(self.prenorm))
        self.batch = nl.Batch(n_rows=1, tokens=nl.ptr(self.token), pos=nl.ptr(self.pos), seq=nl.ptr(self.seq),
                              n_out=1, out_rows=nl.ptr(self.out_rows), logits=nl.ptr(self.logits),
                              capture=ctypes.cast(self._capture, ctypes.c_void_p), hidden_final=None,
                              hidden_in=nl.ptr(self.hidden))


runtime_class = NativeEagle3Runtime
