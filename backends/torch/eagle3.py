"""EAGLE-3 draft runtime on torch (docs/model-formats.md §2.5): fc encoder + one Llama layer over [embedding; g].

Weights are the GGUF's (Q/K rows llama-permuted, so rope pairs are interleaved: NORM). Token
embeddings and the output head come from the draft file when present, else from the target's GGUF.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from spekula.backends.torch.draft_common import (
    KVStore,
    TorchDraftBase,
    Weights,
    apply_rope,
    device_dtype,
    rms_norm,
    scatter_vocab,
    swiglu,
    target_embeddings,
)
from spekula.core.backend import BackendOptions, ModelInfo
from spekula.core.drafting.draft_models import DraftModelInfo, Eagle3Out, Eagle3Rows, Eagle3Runtime
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile


class TorchEagle3Runtime(TorchDraftBase, Eagle3Runtime):
    rope_neox: ClassVar[bool] = False
    def __init__(self, f: GGUFFile, info: DraftModelInfo, target: ModelInfo, options: BackendOptions) -> None:
        self.info = info
        self.device, self.dtype = device_dtype(options)
        a = "eagle3"
        H = info.n_embd
        self.read_attention(f, a, H)
        self.norm_before_residual = bool(f.get(f"{a}.norm_before_residual", False))
        norm_before_fc = bool(f.get(f"{a}.norm_before_fc", False))
        if int(f.get(f"{a}.block_count", 1)) != 1:
            raise ModelFileError(f.path, "eagle3 drafts have exactly one decoder layer")

        w = Weights(f, self.device, self.dtype)
        n_in = 3 * info.target_hidden
        q_out, kv_out = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        n_ff = int(f.require(f"{a}.feed_forward_length"))
        self.fc = w.get("fc.weight", (H, n_in))
        self.enc_norm = w.get("enc.output_norm.weight", (n_in,)) if norm_before_fc else None
        self.attn_norm = w.get("blk.0.attn_norm.weight", (H,))
        self.attn_norm_2 = w.get("blk.0.attn_norm_2.weight", (H,))
        self.wq = w.get("blk.0.attn_q.weight", (q_out, 2 * H))
        self.wk = w.get("blk.0.attn_k.weight", (kv_out, 2 * H))
        self.wv = w.get("blk.0.attn_v.weight", (kv_out, 2 * H))
        self.wo = w.get("blk.0.attn_output.weight", (H, q_out))
        self.ffn_norm = w.get("blk.0.ffn_norm.weight", (H,))
        self.gate = w.get("blk.0.ffn_gate.weight", (n_ff, H))
        self.up = w.get("blk.0.ffn_up.weight", (n_ff, H))
        self.down = w.get("blk.0.ffn_down.weight", (H, n_ff))
        self.out_norm = w.get("output_norm.weight", (H,))
        self.rope_freqs = w.opt("rope_freqs.weight", (self.n_rot // 2,), f32=True)

        own_embd, own_head = w.opt("token_embd.weight"), w.opt("output.weight")
        if own_embd is None or own_head is None:
            t_embd, t_head = target_embeddings(target.path, self.device, self.dtype)
        self.embd = own_embd if own_embd is not None else t_embd
        if self.embd.shape != (info.n_vocab, H):
            raise ModelFileError(f.path, f"token embeddings {tuple(self.embd.shape)} do not fit ({info.n_vocab}, {H})")
        # Without its own head the draft uses the target's full-vocabulary head and d2t does not apply.
        self.head = own_head if own_head is not None else t_head
        self.d2t: torch.Tensor | None = None
        if own_head is not None and w.has("d2t"):
            d2t = f.tensor("d2t").data
            self.d2t = torch.from_numpy(np.asarray(d2t, dtype=np.int64).copy()).to(self.device)
            if self.head.shape[0] != self.d2t.shape[0]:
                raise ModelFileError(f.path, f"output rows {self.head.shape[0]} != d2t entries {self.d2t.shape[0]}")
        if self.head.shape[1] != H or (self.d2t is None and self.head.shape[0] != info.n_vocab):
            raise ModelFileError(f.path, f"output head {tuple(self.head.shape)} does not fit the draft")
        self.kv = KVStore(1, self.n_head_kv, self.head_dim, options.n_ctx, options.n_seq_max, self.device, self.dtype)

    # --- graphs ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, features: np.ndarray) -> np.ndarray:
        x = self.features_in(features, "eagle3")
        if self.enc_norm is not None:
            x = rms_norm(x, self.enc_norm, self.eps)
        return F.linear(x, self.fc).float().cpu().numpy()

    @torch.inference_mode()
    def decode(self, rows: Sequence[Eagle3Rows]) -> list[Eagle3Out]:
        if not rows:
            return []
        tokens = torch.from_numpy(np.concatenate([np.asarray(r.tokens, dtype=np.int64) for r in rows])).to(self.device)
        g = torch.from_numpy(np.concatenate([np.asarray(r.hidden, dtype=np.float32) for r in rows])).to(self.device, self.dtype)
        positions = torch.cat([torch.arange(r.start, r.start + len(r.tokens)) for r in rows]).to(self.device)
        e = rms_norm(self.embd[tokens], self.attn_norm, self.eps)
        gn = rms_norm(g, self.attn_norm_2, self.eps)
        x = torch.cat([e, gn], dim=-1)
        residual = gn if self.norm_before_residual else g
        n = x.shape[0]
        q = F.linear(x, self.wq).view(n, self.n_head, self.head_dim)
        k = F.linear(x, self.wk).view(n, self.n_head_kv, self.head_dim)
        v = F.linear(x, self.wv).view(n, self.n_head_kv, self.head_dim)
        cos, sin = self.rope(positions)
        q, k = apply_rope(q, cos, sin, neox=False), apply_rope(k, cos, sin, neox=False)
        attn = self.attend_spans(0, [(r.seq_id, r.start, len(r.tokens)) for r in rows], q, k, v, causal=True)
        h1 = F.linear(attn, self.wo) + residual
        h2 = h1 + swiglu(rms_norm(h1, self.ffn_norm, self.eps), self.gate, self.up, self.down)
        want = torch.tensor([r.want_logits for r in rows for _ in range(len(r.tokens))], device=self.device)
        logits = None
        if bool(want.any()):
            z = F.linear(rms_norm(h2[want], self.out_norm, self.eps), self.head).float()
            logits = scatter_vocab(z, self.d2t, self.info.n_vocab, float("-inf")).cpu().numpy()
        prenorm = h2.float().cpu().numpy()
        outs: list[Eagle3Out] = []
        off = li = 0
        for r in rows:
            m = len(r.tokens)
            rl = None
            if r.want_logits and logits is not None:
                rl = logits[li:li + m]
                li += m
            outs.append(Eagle3Out(rl, prenorm[off:off + m]))
            off += m
        return outs


runtime_class = TorchEagle3Runtime
