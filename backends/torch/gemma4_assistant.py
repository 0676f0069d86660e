"""Gemma 4's assistant drafter (llama.cpp's ``gemma4-assistant``) on torch, over a torch Gemma 4 target's KV.

The assistant keeps no KV cache. One step of sequence s decodes one token x with a hidden state h
(the target's post-norm hidden of the token before x, or the previous step's projected output) at the
position P of x; every step of a draft is at the same P, and reads the target's keys [0, P):

    u = pre_projection [E_target[x] * sqrt(n_embd_target); h]
    per block: q-only attention (RMS-normed per head, roped as the target's blocks of the block's kind,
               scale 1) over the KV of the target's last block of that kind (sliding: n_layer - 2,
               global: n_layer - 1, as llama.cpp maps them), attn post-norm, residual, the GELU-gated FFN
               with its pre- and post-norms, residual, times the block's output scale
    y = rmsnorm(u, output_norm); logits = E_assistant . y (tied); h_next = post_projection . y

A sliding block's query at P sees the keys at (P - W, P), as llama.cpp's window (transformers' assistant
takes the last W keys: the two differ once P >= W).
The rope tables are the target's (the assistant's file must name the same rope), so queries and the
target's cached keys are roped alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from spekula.backends.gguf.weights import dequantize
from spekula.backends.torch.backend import TorchBackend
from spekula.backends.torch.draft_common import rms_norm
from spekula.backends.torch.kv import SeqCache
from spekula.backends.torch.model import AttnWeights
from spekula.core.backend import Backend
from spekula.core.drafting.assistant_runtime import AssistantInfo, AssistantRow, AssistantRuntime
from spekula.core.drafting.mtp_runtime import MtpOut
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

ARCH = "gemma4-assistant"


@dataclass
class _Block:
    sliding: bool
    head_dim: int
    attn_norm: torch.Tensor
    wq: torch.Tensor  # [n_head * hd, n]
    q_norm: torch.Tensor
    wo: torch.Tensor  # [n, n_head * hd]
    attn_post_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    ffn_post_norm: torch.Tensor
    out_scale: torch.Tensor
    kv_layer: int  # the target's KV layer this block reads
    n_kv: int  # that layer's KV heads (the cache's first ones)


class TorchGemma4Assistant(AssistantRuntime):
    """The assistant's weights and same-position steps over the target's caches."""

    def __init__(self, f: GGUFFile, info: AssistantInfo, target: Backend) -> None:
        if f.architecture != ARCH:
            raise ModelFileError(f.path, f"not a {ARCH} file ({f.architecture})")
        if not isinstance(target, TorchBackend):
            raise ConfigError(f"a {ARCH} drafter on torch reads a torch target's KV cache")
        self.info = info
        thp = target.hparams
        if not any(thp.swa_layers) or all(thp.swa_layers[:thp.n_layer]):
            # it attends the target's last sliding and last global KV, so the target must have both kinds
            raise ConfigError(f"a {ARCH} drafter reads a target's sliding and global KV; the target "
                              f"({thp.arch}) does not have both kinds of blocks")
        self.target, self.dtype, self.device = target, target.dtype, target.device

        def key(name: str) -> Any:
            return f.require(f"{ARCH}.{name}")

        n_layer = int(key("block_count"))
        self.n_embd_backbone = int(key("embedding_length_out"))
        if self.n_embd_backbone != thp.n_embd:
            raise ConfigError(f"{f.path} drafts for a target of width {self.n_embd_backbone}, "
                              f"the target has {thp.n_embd}")
        pattern = list(f.require(f"{ARCH}.attention.sliding_window_pattern"))
        if (int(key("attention.sliding_window")) != thp.sliding_window
                or float(key("rope.freq_base")) != thp.rope_base
                or float(key("rope.freq_base_swa")) != thp.rope_base_swa):
            raise ConfigError(f"{f.path}: its window or rope differs from the target's, whose KV it reads")
        self.n_head = int(key("attention.head_count"))
        self.eps = float(key("attention.layer_norm_rms_epsilon"))
        self.window = thp.sliding_window
        tm = target.model
        kv_of = {True: tm.layers[thp.n_layer - 2].mixer, False: tm.layers[thp.n_layer - 1].mixer}
        if not (isinstance(kv_of[True], AttnWeights) and kv_of[True].sliding
                and isinstance(kv_of[False], AttnWeights) and not kv_of[False].sliding):
            raise ConfigError(f"a {ARCH} drafter needs a target whose last two blocks are sliding, then global")

        def t(name: str) -> torch.Tensor:
            if not f.has_tensor(name):
                raise ModelFileError(f.path, f"missing tensor {name!r}")
            return torch.from_numpy(dequantize(f.tensor(name), f.path)).to(self.device, self.dtype)

        self.embd = t("token_embd.weight")
        self.out_norm = t("output_norm.weight")
        self.pre = t("nextn.pre_projection.weight")
        self.post = t("nextn.post_projection.weight")
        self.blocks: list[_Block] = []
        for i in range(n_layer):
            b = f"blk.{i}."
            sliding = bool(pattern[i])
            mixer = kv_of[sliding]
            assert isinstance(mixer, AttnWeights)
            self.blocks.append(_Block(
                sliding, int(mixer.head_dim), t(b + "attn_norm.weight"), t(b + "attn_q.weight"),
                t(b + "attn_q_norm.weight"), t(b + "attn_output.weight"), t(b + "post_attention_norm.weight"),
                t(b + "ffn_norm.weight"), t(b + "ffn_gate.weight"), t(b + "ffn_up.weight"), t(b + "ffn_down.weight"),
                t(b + "post_ffw_norm.weight"), t(b + "layer_output_scale.weight"), int(mixer.kv_layer),
                int(mixer.n_head_kv or thp.n_head_kv)))

    @torch.inference_mode()
    def step(self, rows: Sequence[AssistantRow]) -> list[MtpOut]:
        return [MtpOut(*self._step(r.target_seq, r.token, r.hidden, r.pos)) for r in rows]

    def _step(self, target_seq: int, token: int, hidden: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(logits [V], next hidden [n_embd_backbone]) of token `token` with `hidden` at `pos`, attending to
        the target's keys at [0, pos) of `target_seq` (one row at a time: drafts need no batch invariance,
        and a step is a handful of small GEMVs)."""
        tm, cache = self.target.model, self.target.kv.get(target_seq)
        if pos <= 0:
            raise ConfigError(f"{ARCH}: a draft at position {pos} has no target keys to read")
        if pos > cache.length:
            raise ConfigError(f"{ARCH}: the target's cache of sequence {target_seq} holds {cache.length} "
                              f"positions, a draft at {pos} needs {pos}")
        e = tm.embd[token] * float(np.sqrt(self.n_embd_backbone))
        h = torch.from_numpy(np.asarray(hidden, np.float32)).to(self.device, self.dtype)
        x = self.pre @ torch.cat([e.to(self.dtype), h])
        tm.rope.ensure(pos + 1)
        rope = tm.rope.tile(torch.tensor([pos], device=self.device))
        for blk in self.blocks:
            x = self._block(blk, x, cache, pos, rope)
        y = rms_norm(x, self.out_norm, self.eps)
        return (self.embd @ y).float().cpu().numpy(), (self.post @ y).float().cpu().numpy()

    def _block(self, blk: _Block, x: torch.Tensor, cache: SeqCache, pos: int,
               rope: dict[str, torch.Tensor]) -> torch.Tensor:
        hd, nh = blk.head_dim, self.n_head
        q = (blk.wq @ rms_norm(x, blk.attn_norm, self.eps)).view(1, nh, hd)
        q = rms_norm(q, blk.q_norm, self.eps)
        cos, sin = (rope["cos_swa"], rope["sin_swa"]) if blk.sliding else (rope["cos"], rope["sin"])
        q = self.target.model.rope.apply(q, cos, sin)[0]  # [nh, hd], the target's rope of this kind
        lo = max(0, pos - self.window + 1) if blk.sliding else 0
        keys = cache.k[blk.kv_layer, : blk.n_kv, lo:pos, :hd]
        vals = cache.v[blk.kv_layer, : blk.n_kv, lo:pos, :hd]
        n_kv = keys.shape[0]
        qg = q.view(n_kv, nh // n_kv, hd)
        probs = torch.softmax((qg @ keys.transpose(1, 2)).float(), dim=-1).to(vals.dtype)  # scale 1
        attn = (probs @ vals).reshape(nh * hd)
        x = x + rms_norm(blk.wo @ attn, blk.attn_post_norm, self.eps)
        hn = rms_norm(x, blk.ffn_norm, self.eps)
        ffn = blk.down @ (F.gelu(blk.gate @ hn, approximate="tanh") * (blk.up @ hn))
        x = x + rms_norm(ffn, blk.ffn_post_norm, self.eps)
        return x * blk.out_scale
