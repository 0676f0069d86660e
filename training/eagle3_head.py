"""The trainable EAGLE-3 draft head: the same network backends/torch/eagle3.py runs, in Hugging Face layout.

One Llama layer over [rmsnorm(embedding of the next token); rmsnorm(g)], where g is the fc projection
of three captured target layer inputs (or, at later draft steps, the layer's own pre-norm output).
Weights are kept in HF order (rotate_half rope); ``spekula convert`` permutes Q/K rows into GGUF's
interleaved order. Training unrolls ``ttt_steps`` draft steps per position ("training-time test"),
each attending to exactly what the runtime's draft KV cache holds when it drafts that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from spekula.backends.torch.draft_common import apply_rope, rms_norm, rope_angles, swiglu
from spekula.training.head_api import HeadMetrics, TargetFacts, TrainBatch, soft_cross_entropy

HF_ARCH = "LlamaForCausalLMEagle3"
INIT_STD = 0.02  # small normal init of every projection (HF's initializer_range)

# module attribute -> tensor name in the SpecForge checkpoint, in a fixed order (the init draws in it)
_HF_NAMES = {
    "fc": "fc.weight",
    "input_layernorm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "q_proj": "midlayer.self_attn.q_proj.weight",
    "k_proj": "midlayer.self_attn.k_proj.weight",
    "v_proj": "midlayer.self_attn.v_proj.weight",
    "o_proj": "midlayer.self_attn.o_proj.weight",
    "post_attention_layernorm": "midlayer.post_attention_layernorm.weight",
    "gate_proj": "midlayer.mlp.gate_proj.weight",
    "up_proj": "midlayer.mlp.up_proj.weight",
    "down_proj": "midlayer.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}


@dataclass(frozen=True)
class Eagle3HeadOptions:
    draft_vocab: int = 8192  # capped at the target vocabulary
    n_ff: int | None = None  # None: the target's feed-forward width
    ttt_steps: int = 4  # unrolled draft steps trained per position
    step_decay: float = 0.8  # loss weight of step k is decay**k, normalised
    layers: tuple[int, ...] | None = None  # target layer-input ids; None: default_eagle3_layers(n_layer)


def default_eagle3_layers(n_layer: int) -> tuple[int, int, int]:
    """EAGLE-3's usual (2, n//2, n-3) layer inputs, pushed apart into distinct ids in [0, n_layer] for
    targets too shallow for them (4 layers -> (2, 3, 4), 2 layers -> (0, 1, 2))."""
    if n_layer < 2:
        raise ValueError(f"EAGLE-3 needs 3 distinct layer inputs; a {n_layer}-layer target has only {n_layer + 1}")
    ids: list[int] = []
    for want in (2, n_layer // 2, n_layer - 3):
        ids.append(max(min(max(want, 0), n_layer), ids[-1] + 1 if ids else 0))
    for i in reversed(range(3)):
        ids[i] = min(ids[i], n_layer if i == 2 else ids[i + 1] - 1)
    return ids[0], ids[1], ids[2]


def draft_vocabulary(token_counts: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` most frequent token ids (ties, zero counts included, by lower id), sorted ascending."""
    counts = np.asarray(token_counts, dtype=np.float64).reshape(-1)
    order = np.argsort(-counts, kind="stable")
    return np.sort(order[:size]).astype(np.int64)


def _shift(x: torch.Tensor, by: int, fill: float | bool) -> torch.Tensor:
    """x[:, t + by] at column t; ``fill`` past the end."""
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


class Eagle3Head(torch.nn.Module):
    """EAGLE-3 head as width-``n_embd`` Llama layer; the frozen target embedding is a non-persistent buffer."""

    kind = "eagle3"

    def __init__(self, facts: TargetFacts, embd: torch.Tensor, draft_ids: np.ndarray, *, n_ff: int,
                 layers: tuple[int, ...], ttt_steps: int, step_decay: float) -> None:
        super().__init__()
        if len(layers) != 3 or len(set(layers)) != 3 or not all(0 <= x <= facts.n_layer for x in layers):
            raise ValueError(f"EAGLE-3 needs 3 distinct target layer ids in [0, {facts.n_layer}], got {layers}")
        if ttt_steps < 1 or step_decay <= 0:
            raise ValueError(f"ttt_steps must be >= 1 and step_decay > 0 (got {ttt_steps}, {step_decay})")
        H, V = facts.n_embd, facts.n_vocab
        if tuple(embd.shape) != (V, H):
            raise ValueError(f"target embeddings {tuple(embd.shape)} do not fit ({V}, {H})")
        self.facts = facts
        self.layers = tuple(int(x) for x in layers)
        self.ttt_steps, self.step_decay = int(ttt_steps), float(step_decay)
        self.n_head, self.n_head_kv, self.head_dim = facts.n_head, facts.n_head_kv, facts.head_dim
        self.eps = facts.rms_eps
        q_out, kv_out = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        shapes = {
            "fc": (H, 3 * H), "input_layernorm": (H,), "hidden_norm": (H,),
            "q_proj": (q_out, 2 * H), "k_proj": (kv_out, 2 * H), "v_proj": (kv_out, 2 * H), "o_proj": (H, q_out),
            "post_attention_layernorm": (H,), "gate_proj": (n_ff, H), "up_proj": (n_ff, H), "down_proj": (H, n_ff),
            "norm": (H,), "lm_head": (len(draft_ids), H),
        }
        for name in _HF_NAMES:
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shapes[name])))
        ids = torch.from_numpy(np.asarray(draft_ids, dtype=np.int64))
        if ids.numel() == 0 or ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError("draft vocabulary ids must be distinct target ids")
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        to_draft = torch.full((V,), -1, dtype=torch.int64)
        to_draft[ids] = torch.arange(ids.numel())
        self.register_buffer("embd", embd.detach().float().clone(), persistent=False)
        self.register_buffer("d2t", ids - torch.arange(ids.numel()))  # HF convention: target id - draft id
        self.register_buffer("t2d", t2d)
        self.register_buffer("target_to_draft", to_draft, persistent=False)
        self.to(embd.device)

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def create(cls, facts: TargetFacts, embd: torch.Tensor, head: torch.Tensor, token_counts: np.ndarray,
               options: Eagle3HeadOptions, seed: int) -> Eagle3Head:
        """A fresh head: draft vocabulary from label counts, lm_head from the target head's rows of it."""
        counts = np.asarray(token_counts).reshape(-1)
        if counts.size != facts.n_vocab:
            raise ValueError(f"token_counts has {counts.size} entries, the target vocabulary {facts.n_vocab}")
        if tuple(head.shape) != (facts.n_vocab, facts.n_embd):
            raise ValueError(f"target head {tuple(head.shape)} does not fit ({facts.n_vocab}, {facts.n_embd})")
        if options.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be >= 1, got {options.draft_vocab}")
        ids = draft_vocabulary(counts, min(options.draft_vocab, facts.n_vocab))
        layers = options.layers if options.layers is not None else default_eagle3_layers(facts.n_layer)
        out = cls(facts, embd, ids, n_ff=options.n_ff or facts.n_ff, layers=tuple(layers),
                  ttt_steps=options.ttt_steps, step_decay=options.step_decay)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name in _HF_NAMES:
                p = getattr(out, name)
                if p.ndim == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
            # The head starts as the target's own head over the draft vocabulary.
            out.lm_head.copy_(head.detach()[torch.from_numpy(ids).to(head.device)].float())
        return out

    @classmethod
    def from_hf(cls, config: dict[str, Any], tensors: dict[str, np.ndarray], embd: torch.Tensor,
                facts: TargetFacts, options: Eagle3HeadOptions | None = None) -> Eagle3Head:
        """Rebuild a head from its own :meth:`hf_checkpoint`; ``options`` supplies only ttt_steps/step_decay."""
        opts = options or Eagle3HeadOptions()
        d2t = np.asarray(tensors["d2t"], dtype=np.int64)
        out = cls(facts, embd, d2t + np.arange(d2t.size), n_ff=int(config["intermediate_size"]),
                  layers=tuple(int(x) for x in config["eagle_aux_hidden_state_layer_ids"]),
                  ttt_steps=opts.ttt_steps, step_decay=opts.step_decay)
        with torch.no_grad():
            for attr, name in _HF_NAMES.items():
                p = getattr(out, attr)
                src = torch.from_numpy(np.asarray(tensors[name], dtype=np.float32))
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: shape {tuple(src.shape)}, expected {tuple(p.shape)}")
                p.copy_(src)
        return out

    # --- forward ---------------------------------------------------------------------------------
    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft-vocabulary entry."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """g = fc(target features) (no norm before fc)."""
        return F.linear(features.to(self.fc.dtype), self.fc)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary of pre-norm outputs h."""
        return F.linear(rms_norm(h, self.norm, self.eps), self.lm_head)

    def _project(self, tokens: torch.Tensor, g: torch.Tensor, pos0: int) -> tuple[torch.Tensor, ...]:
        """q, k, v [B, heads, T, head_dim] of rows (tokens[:, t], g[:, t]) at positions pos0 + t."""
        B, T = tokens.shape
        x = torch.cat([rms_norm(self.embd[tokens].to(g.dtype), self.input_layernorm, self.eps),
                       rms_norm(g, self.hidden_norm, self.eps)], dim=-1)
        q = F.linear(x, self.q_proj).view(B, T, self.n_head, self.head_dim)
        k = F.linear(x, self.k_proj).view(B, T, self.n_head_kv, self.head_dim)
        v = F.linear(x, self.v_proj).view(B, T, self.n_head_kv, self.head_dim)
        positions = torch.arange(pos0, pos0 + T, device=tokens.device)
        cos, sin = rope_angles(positions, self.head_dim, self.facts.rope_theta, 1.0, None)
        q, k = apply_rope(q, cos, sin, neox=True), apply_rope(k, cos, sin, neox=True)  # HF rotate_half pairs
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _finish(self, attn: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """o_proj + residual g, then the SwiGLU block: the pre-norm output h."""
        B, _, T, _ = attn.shape
        h = F.linear(attn.transpose(1, 2).reshape(B, T, -1), self.o_proj) + g
        return h + swiglu(rms_norm(h, self.post_attention_layernorm, self.eps), self.gate_proj, self.up_proj,
                          self.down_proj)

    def draft_states(self, tokens: torch.Tensor, features: torch.Tensor, valid: torch.Tensor,
                     n_steps: int | None = None) -> list[torch.Tensor]:
        """Pre-norm outputs h^k [B, T, H] of draft steps k = 0..n_steps-1, teacher-forced.

        Step k's row t reads (token t+1+k, h^{k-1}_t) (step 0: g_t) at position t+k and attends to the
        step-0 rows at positions <= t plus its own chain rows of steps 1..k: what the runtime's draft
        KV cache holds when it drafts step k after a pending row at t. Step-0 rows lacking a token or
        features are masked out as keys (each row always sees itself, so no softmax is empty).
        """
        B, T = tokens.shape
        dev = tokens.device
        g = self.encode(features)
        ok0 = valid & _shift(valid, 1, False)
        idx = torch.arange(T, device=dev)
        eye = idx[:, None] == idx[None, :]
        mask0 = (idx[None, :] <= idx[:, None])[None] & (ok0[:, None, :] | eye[None])  # [B, Tq, Tk]
        group = self.n_head // self.n_head_kv
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        for k in range(n_steps or self.ttt_steps):
            q, kk, vv = self._project(_shift(tokens, 1 + k, 0), g, k)
            keys.append(kk)
            values.append(vv)
            mask = torch.cat([mask0, eye[None].expand(B, T, T).repeat(1, 1, k)], dim=-1) if k else mask0
            attn = F.scaled_dot_product_attention(
                q, torch.cat(keys, dim=2).repeat_interleave(group, dim=1),
                torch.cat(values, dim=2).repeat_interleave(group, dim=1), attn_mask=mask[:, None])
            g = self._finish(attn, g)
            states.append(g)
        return states

    # --- training --------------------------------------------------------------------------------
    def loss(self, batch: TrainBatch, gen: torch.Generator) -> tuple[torch.Tensor, HeadMetrics]:
        """Weighted mean over steps (decay**k, normalised over steps with any prediction) of the mean
        cross-entropy over the draft vocabulary. Step k at row t predicts label t+1+k; it counts where
        the needed tokens exist, loss_mask holds and the label is in the draft vocabulary; with soft
        labels the step learns the target's top-K there (restricted to the draft vocabulary) instead of
        its argmax alone. No randomness, so ``gen`` goes unused."""
        del gen
        dev = self.embd.device
        tokens, labels = batch.tokens.to(dev), batch.labels.to(dev)
        valid, loss_mask = batch.valid.to(dev), batch.loss_mask.to(dev)
        soft_ids = None if batch.soft_ids is None else batch.soft_ids.to(dev)
        soft_logp = None if batch.soft_logp is None else batch.soft_logp.to(dev)
        states = self.draft_states(tokens, batch.features.to(dev), valid)
        metrics = HeadMetrics()
        total: torch.Tensor | None = None
        weight_sum = 0.0
        have = valid & _shift(valid, 1, False)  # row t has features and its input token
        for k, h in enumerate(states):
            if k:
                have = have & _shift(valid, 1 + k, False)
            target = _shift(labels, 1 + k, -1)
            draft_label = self.target_to_draft[target.clamp(min=0)]
            counted = have & _shift(loss_mask, 1 + k, False) & (target >= 0) & (draft_label >= 0)
            n = int(counted.sum())
            correct = 0
            if n:
                logits = self.draft_logits(h[counted]).float()
                y = draft_label[counted]
                w = self.step_decay ** k
                if soft_ids is not None and soft_logp is not None:
                    ids = _shift(soft_ids, 1 + k, -1)[counted]
                    ids = torch.where(ids >= 0, self.target_to_draft[ids.clamp(min=0)], -1)
                    logp = _shift(soft_logp, 1 + k, 0.0)[counted]
                    term = soft_cross_entropy(logits, ids, logp).mean() * w
                else:
                    term = F.cross_entropy(logits, y) * w
                total = term if total is None else total + term
                weight_sum += w
                correct = int((logits.argmax(-1) == y).sum())
            metrics.correct.append(float(correct))
            metrics.count.append(float(n))
        if total is None:  # nothing to learn from: a zero that still reaches every parameter
            return sum(p.sum() for p in self.parameters()) * 0.0, metrics
        return total / weight_sum, metrics

    # --- export ----------------------------------------------------------------------------------
    def hf_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """SpecForge ``LlamaForCausalLMEagle3`` config and tensors (float32; d2t int64, t2d bool)."""
        f = self.facts
        config: dict[str, Any] = {
            "architectures": [HF_ARCH], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": f.n_embd, "intermediate_size": int(self.gate_proj.shape[0]),
            "num_attention_heads": f.n_head, "num_key_value_heads": f.n_head_kv, "head_dim": f.head_dim,
            "num_hidden_layers": 1, "vocab_size": f.n_vocab, "draft_vocab_size": int(self.lm_head.shape[0]),
            "rms_norm_eps": f.rms_eps, "rope_theta": f.rope_theta, "max_position_embeddings": f.n_ctx_train,
            "eagle_aux_hidden_state_layer_ids": list(self.layers), "target_hidden_size": f.n_embd,
            "tie_word_embeddings": False, "torch_dtype": "float32",
        }
        tensors = {name: getattr(self, attr).detach().float().cpu().numpy().copy()
                   for attr, name in _HF_NAMES.items()}
        tensors["d2t"] = self.d2t.cpu().numpy().astype(np.int64)
        tensors["t2d"] = self.t2d.cpu().numpy().astype(bool)
        return config, tensors
