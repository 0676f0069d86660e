"""DFlash draft heads on spekula's native kernels: the head's blocks are a native context.

A DFlash head (docs/model-formats.md, "DFlash") never runs the target's features through its blocks:
``fc`` and ``enc.output_norm`` turn them into one row per target position, and every block's k and v
projections of that row become the block's keys and values there (``inject``; the C side's
``sk_inject_kv``, which computes nothing else for those rows). A draft block ``[last, MASK, ...]`` then
runs through the blocks as ordinary rows whose attention reaches the whole block (``key_end``), not
only the rows before them, and reads the injected context before it. Blocks with their own q/k norms
(Qwen3-style heads) run as the target's qwen3 blocks do; the output head is the draft's own (over a
reduced vocabulary with ``d2t``, answered as such: ``DFlashOut.vocab``) or borrowed from the target.

DSpark files (a Markov head on top) stay on the torch runtime: their greedy chaining through the block
is per-token Python either way. Like the EAGLE-3 runtime, the context runs over the native target's
(its thread pool and prepared embedding and head), and a draft's numerics need not match the torch
runtime's bit for bit: the target verifies every token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from spekula.backends.gguf.dflash_format import check_supported
from spekula.backends.native import lib as nl
from spekula.backends.native.backend import NativeBackend, check_head_options, default_threads
from spekula.backends.native.eagle3 import rope_inverse_frequencies
from spekula.backends.native.head import NativeHeadContext
from spekula.backends.native.weights import NativeWeights
from spekula.core.backend import Backend, BackendOptions, ModelInfo
from spekula.core.drafting.draft_models import (
    DFlashBlock,
    DFlashOut,
    DFlashRuntime,
    DraftModelInfo,
    read_draft_attention,
)
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile


class NativeDFlashRuntime(NativeHeadContext, DFlashRuntime):
    head_name = "DFlash"

    def __init__(self, f: GGUFFile, info: DraftModelInfo, target: ModelInfo, options: BackendOptions,
                 target_backend: Backend | None = None) -> None:
        check_head_options(options, "DFlash")
        if info.kind != "dflash":
            raise ConfigError(f"the native DFlash runtime runs DFlash heads, not {info.kind} ({f.path})")
        check_supported(f, "dflash")
        self.info, self.options = info, options
        self._lib = nl.lib()
        self._ctx: int | None = None
        a, H = "dflash", info.n_embd
        att = read_draft_attention(f, a, H)
        n_layer = int(f.require(f"{a}.block_count"))
        n_ff = int(f.require(f"{a}.feed_forward_length"))
        q_out, kv_out, hd = att.n_head * att.head_dim, att.n_head_kv * att.head_dim, att.head_dim
        self.causal = bool(f.get(f"{a}.attention.causal", False))
        w = self._weights = NativeWeights(f, None)

        def norm(name: str, n: int) -> int | None:
            v = w.vector(name)
            if v is None or v.size != n:
                raise ModelFileError(f.path, f"tensor {name!r} has {0 if v is None else v.size} entries, expected {n}")
            return nl.ptr(v)

        layers = (nl.Layer * n_layer)()
        for i, L in enumerate(layers):
            L.attn_norm, L.ffn_norm = norm(f"blk.{i}.attn_norm.weight", H), norm(f"blk.{i}.ffn_norm.weight", H)
            L.q_norm, L.k_norm = norm(f"blk.{i}.attn_q_norm.weight", hd), norm(f"blk.{i}.attn_k_norm.weight", hd)
            L.wq = w.matrix(f"blk.{i}.attn_q.weight", shape=(q_out, H))
            L.wk = w.matrix(f"blk.{i}.attn_k.weight", shape=(kv_out, H))
            L.wv = w.matrix(f"blk.{i}.attn_v.weight", shape=(kv_out, H))
            L.wo = w.matrix(f"blk.{i}.attn_output.weight", shape=(H, q_out))
            L.w_gate = w.matrix(f"blk.{i}.ffn_gate.weight", shape=(n_ff, H))
            L.w_up = w.matrix(f"blk.{i}.ffn_up.weight", shape=(n_ff, H))
            L.w_down = w.matrix(f"blk.{i}.ffn_down.weight", shape=(H, n_ff))
        w.structs.append(layers)
        self._inv = rope_inverse_frequencies(f, att)

        base = target_backend.context if isinstance(target_backend, NativeBackend) else None
        embd, head, own_head = self.embedding_and_head(w, target, base, tied=True)
        # A draft-vocabulary head answers over d2t's ids; a borrowed head over the whole vocabulary.
        self.vocab: np.ndarray | None = None
        if own_head and f.has_tensor("d2t"):
            self.vocab = self.draft_vocabulary(f)
        n_out = info.n_vocab if self.vocab is None else self.vocab.size
        if head.n_rows != n_out or head.n_cols != H:
            raise ModelFileError(f.path, f"output head ({head.n_rows}, {head.n_cols}) does not fit ({n_out}, {H})")
        self.n_out_vocab = n_out
        cfg = nl.Config(
            n_vocab=info.n_vocab, n_embd=H, n_layer=n_layer, n_head=att.n_head, n_head_kv=att.n_head_kv,
            head_dim=hd, n_ff=n_ff, n_rot=att.n_rot, rope_neox=1, n_ctx=options.n_ctx, n_seq_max=options.n_seq_max,
            n_threads=0 if base is not None else (options.threads if options.threads > 0 else default_threads()),
            rms_eps=att.eps, attn_scale=1.0 / math.sqrt(hd), rope_inv_freq=nl.ptr(self._inv),
            output_norm=norm("output_norm.weight", H), token_embd=embd, output=head, layers=layers,
            wide_input=nl.WIDE_NONE,
            ctx_proj=w.matrix("fc.weight", shape=(H, len(info.target_layers) * info.target_hidden)),
            ctx_norm=norm("enc.output_norm.weight", H))
        self.open_context(cfg, base, str(f.path))

    # --- graphs ----------------------------------------------------------------------------------
    def inject(self, seq_id: int, features: np.ndarray, start: int) -> None:
        n_in = len(self.info.target_layers) * self.info.target_hidden
        x = np.ascontiguousarray(features, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != n_in:
            raise ValueError(f"dflash features must be [T, {n_in}], got {tuple(x.shape)}")
        if x.shape[0] == 0:
            return
        entry = self._seqs.get(seq_id)
        self.check_write(seq_id, start, x.shape[0])
        rc = self._lib.sk_inject_kv(self._live(), nl.ptr(x), x.shape[0], entry.slot, start)
        if rc == -1:
            raise MemoryError(f"native DFlash context of {x.shape[0]} rows: out of memory for its scratch")
        if rc != 0:
            raise ConfigError(f"native DFlash context injection rejected its rows (rc={rc})")
        entry.length = start + x.shape[0]

    def draft_blocks(self, blocks: Sequence[DFlashBlock]) -> list[DFlashOut]:
        if not blocks:
            return []
        if len({b.seq_id for b in blocks}) != len(blocks):
            raise ConfigError("a draft sequence appears twice in one DFlash forward")
        for b in blocks:
            self.check_write(b.seq_id, b.start, len(b.tokens))
        sizes = [len(b.tokens) for b in blocks]
        m = int(sum(sizes))
        tokens = np.concatenate([np.asarray(b.tokens, dtype=np.int32) for b in blocks])
        pos = np.concatenate([np.arange(b.start, b.start + len(b.tokens), dtype=np.int32) for b in blocks])
        seq = np.concatenate([np.full(len(b.tokens), self._seqs.get(b.seq_id).slot, np.int32) for b in blocks])
        # Every row of a block sees the whole block (and the context before it), unless the head is causal.
        key_end = np.concatenate([np.full(len(b.tokens), b.start + len(b.tokens), np.int32) for b in blocks])
        # Only the rows each caller reads go through the output head (DFlashBlock.logit_rows).
        wanted = [np.arange(n, dtype=np.int32) if b.logit_rows is None else _logit_rows(b.logit_rows, n)
                  for b, n in zip(blocks, sizes, strict=True)]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
        out_rows = np.concatenate([w + s for w, s in zip(wanted, starts, strict=True)]).astype(np.int32)
        logits = np.empty((out_rows.size, self.n_out_vocab), np.float32)
        batch = nl.Batch(n_rows=m, tokens=nl.ptr(tokens), pos=nl.ptr(pos), seq=nl.ptr(seq), n_out=out_rows.size,
                         out_rows=nl.ptr(out_rows) if out_rows.size else None, logits=nl.ptr(logits), capture=None,
                         hidden_final=None, hidden_in=None, key_end=None if self.causal else nl.ptr(key_end))
        nl.forward(self._live(), batch, "native DFlash forward")
        outs: list[DFlashOut] = []
        off = 0
        for b, n, w in zip(blocks, sizes, wanted, strict=True):
            self._seqs.get(b.seq_id).length = b.start + n
            outs.append(DFlashOut(logits[off:off + w.size], None, self.vocab))
            off += w.size
        return outs


def _logit_rows(rows: Sequence[int], n: int) -> np.ndarray:
    """A block's wanted logit rows as int32 block indices, checked: increasing, within the block."""
    wanted = np.asarray(rows, dtype=np.int32).reshape(-1)
    if wanted.size and (wanted[0] < 0 or wanted[-1] >= n or np.any(np.diff(wanted) <= 0)):
        raise ValueError(f"DFlash logit rows {wanted.tolist()} are not increasing block indices below {n}")
    return wanted


runtime_class = NativeDFlashRuntime
