"""DFlash / DSpark draft runtime on torch (docs/model-formats.md §3.3, §4).

Target features enter only as extra keys/values in every draft layer (``inject``, written by
position); a draft block ``[last, MASK, ...]`` then runs once, non-causally, over those entries and
its own. DSpark adds the Markov head, chained greedily across the block, and the confidence head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from spekula.backends.gguf.dflash_format import check_supported
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
from spekula.core.drafting.draft_models import DFlashBlock, DFlashOut, DFlashRuntime, DraftModelInfo
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class TorchDFlashRuntime(TorchDraftBase, DFlashRuntime):
    rope_neox: ClassVar[bool] = True

    def __init__(self, f: GGUFFile, info: DraftModelInfo, target: ModelInfo, options: BackendOptions) -> None:
        self.info = info
        self.device, self.dtype = device_dtype(options)
        a = "dflash"
        check_supported(f, a)
        H = info.n_embd
        self.n_layer = int(f.require(f"{a}.block_count"))
        self.read_attention(f, a, H)
        self.causal = bool(f.get(f"{a}.attention.causal", False))

        w = Weights(f, self.device, self.dtype)
        n_ff = int(f.require(f"{a}.feed_forward_length"))
        q_out, kv_out, hd = self.n_head * self.head_dim, self.n_head_kv * self.head_dim, self.head_dim
        self.fc = w.get("fc.weight", (H, len(info.target_layers) * H))
        self.enc_norm = w.get("enc.output_norm.weight", (H,))
        self.layers = [
            _Layer(
                w.get(f"blk.{i}.attn_norm.weight", (H,)), w.get(f"blk.{i}.attn_q.weight", (q_out, H)),
                w.get(f"blk.{i}.attn_k.weight", (kv_out, H)), w.get(f"blk.{i}.attn_v.weight", (kv_out, H)),
                w.get(f"blk.{i}.attn_output.weight", (H, q_out)), w.get(f"blk.{i}.attn_q_norm.weight", (hd,)),
                w.get(f"blk.{i}.attn_k_norm.weight", (hd,)), w.get(f"blk.{i}.ffn_norm.weight", (H,)),
                w.get(f"blk.{i}.ffn_gate.weight", (n_ff, H)), w.get(f"blk.{i}.ffn_up.weight", (n_ff, H)),
                w.get(f"blk.{i}.ffn_down.weight", (H, n_ff)),
            )
            for i in range(self.n_layer)
        ]
        self.out_norm = w.get("output_norm.weight", (H,))
        self.rope_freqs = w.opt("rope_freqs.weight", (self.n_rot // 2,), f32=True)

        own_embd, own_head = w.opt("token_embd.weight"), w.opt("output.weight")
        if own_embd is None or own_head is None:
            t_embd, t_head = target_embeddings(target.path, self.device, self.dtype)
        self.embd = own_embd if own_embd is not None else t_embd
        # Head order as llama.cpp: own output, else own (tied) token_embd, else the target's output.
        self.head = own_head if own_head is not None else (own_embd if own_embd is not None else t_head)
        if self.embd.shape != (info.n_vocab, H):
            raise ModelFileError(f.path, f"token embeddings {tuple(self.embd.shape)} do not fit ({info.n_vocab}, {H})")
        self.d2t: torch.Tensor | None = None
        if w.has("d2t"):
            self.d2t = torch.from_numpy(np.asarray(f.tensor("d2t").data, dtype=np.int64).copy()).to(self.device)
        # A draft-vocabulary head needs d2t to land in the target vocabulary; a borrowed head does not.
        self.head_d2t = self.d2t if own_head is not None else None
        n_out = info.n_vocab_draft if self.head_d2t is not None else info.n_vocab
        if self.head.shape != (n_out, H):
            raise ModelFileError(f.path, f"output head {tuple(self.head.shape)} does not fit ({n_out}, {H})")

        self.markov_w1 = w.opt("markov_w1.weight", f32=True)
        self.markov_w2 = w.opt("markov_w2.weight", f32=True)
        self.markov_scale = w.opt("markov_w2.scale", (1,), f32=True)
        self.conf_w = w.opt("conf_proj.weight", f32=True)
        self.conf_b = w.opt("conf_proj.bias", (1,), f32=True)
        if self.markov_w1 is not None:
            if self.markov_w2 is None or self.markov_w1.shape[0] != info.n_vocab or \
                    self.markov_w2.shape != (info.n_vocab_draft, self.markov_w1.shape[1]):
                raise ModelFileError(f.path, "markov head tensors do not fit the vocabulary")
            if self.conf_w is not None and self.conf_w.shape != (1, H + self.markov_w1.shape[1]):
                raise ModelFileError(f.path, f"conf_proj.weight {tuple(self.conf_w.shape)} != (1, {H + self.markov_w1.shape[1]})")
        self.kv = KVStore(self.n_layer, self.n_head_kv, self.head_dim, options.n_ctx, options.n_seq_max,
                          self.device, self.dtype)

    # --- graphs ----------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(positions)
        return apply_rope(x, cos, sin, neox=True)

    @torch.inference_mode()
    def inject(self, seq_id: int, features: np.ndarray, start: int) -> None:
        x = self.features_in(features, "dflash")
        c = rms_norm(F.linear(x, self.fc), self.enc_norm, self.eps)
        n = c.shape[0]
        positions = torch.arange(start, start + n, device=self.device)
        for li, L in enumerate(self.layers):
            k = rms_norm(F.linear(c, L.wk).view(n, self.n_head_kv, self.head_dim), L.k_norm, self.eps)
            v = F.linear(c, L.wv).view(n, self.n_head_kv, self.head_dim)
            self.kv.write(seq_id, li, start, self._rope(k, positions), v)

    @torch.inference_mode()
    def draft_blocks(self, blocks: Sequence[DFlashBlock]) -> list[DFlashOut]:
        if not blocks:
            return []
        tokens = torch.from_numpy(np.concatenate([np.asarray(b.tokens, dtype=np.int64) for b in blocks])).to(self.device)
        positions = torch.cat([torch.arange(b.start, b.start + len(b.tokens)) for b in blocks]).to(self.device)
        x = self.embd[tokens]
        n = x.shape[0]
        spans = [(b.seq_id, b.start, len(b.tokens)) for b in blocks]
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L.attn_norm, self.eps)
            q = self._rope(rms_norm(F.linear(h, L.wq).view(n, self.n_head, self.head_dim), L.q_norm, self.eps), positions)
            k = self._rope(rms_norm(F.linear(h, L.wk).view(n, self.n_head_kv, self.head_dim), L.k_norm, self.eps), positions)
            v = F.linear(h, L.wv).view(n, self.n_head_kv, self.head_dim)
            attn = self.attend_spans(li, spans, q, k, v, causal=self.causal)
            x = x + F.linear(attn, L.wo)
            x = x + swiglu(rms_norm(x, L.ffn_norm, self.eps), L.gate, L.up, L.down)
        hid = rms_norm(x, self.out_norm, self.eps)
        logits = scatter_vocab(F.linear(hid, self.head).float(), self.head_d2t, self.info.n_vocab, float("-inf"))
        outs: list[DFlashOut] = []
        off = 0
        for b in blocks:
            m = len(b.tokens)
            bl, conf = logits[off:off + m], None
            if self.markov_w1 is not None and m <= self.info.block_size:  # longer blocks skip the head (docs/model-formats.md §4)
                bl, conf = self._markov(bl, hid[off:off + m].float(), int(b.tokens[0]))
            if b.logit_rows is not None:  # the Markov chain runs through every row; the caller reads these
                rows = torch.as_tensor(list(b.logit_rows), dtype=torch.long, device=bl.device)
                bl, conf = bl[rows], None if conf is None else conf[rows]
            outs.append(DFlashOut(bl.cpu().numpy(), None if conf is None else conf.cpu().numpy()))
            off += m
        return outs

    def _markov(self, base: torch.Tensor, hid: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Chain the low-rank previous-token bias greedily through the block (docs/model-formats.md §4)."""
        assert self.markov_w1 is not None and self.markov_w2 is not None
        out = base.clone()
        conf = torch.ones(base.shape[0], device=base.device) if self.conf_w is not None else None
        prev = first
        for i in range(0 if self.info.sample_from_anchor else 1, base.shape[0]):
            u = self.markov_w1[prev]
            bias = F.linear(u, self.markov_w2)
            if self.markov_scale is not None:
                bias = bias * self.markov_scale
            out[i] = base[i] + scatter_vocab(bias[None, :], self.d2t, self.info.n_vocab, 0.0)[0]
            if conf is not None and self.conf_w is not None:
                b = self.conf_b if self.conf_b is not None else 0.0
                conf[i] = torch.sigmoid(F.linear(torch.cat([hid[i], u]), self.conf_w) + b)[0]
            prev = int(torch.argmax(out[i]))
        return out, conf


runtime_class = TorchDFlashRuntime
