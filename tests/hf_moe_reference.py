"""Plain float64 references of Hugging Face's Qwen3-MoE and GLM-4.5-MoE decoders, written from their
configs and per-expert checkpoint tensors (``mlp.experts.E.*``), a different code path from both the
GGUF runtimes (which read stacked ``ffn_*_exps`` tensors and run experts as grouped GEMMs) and
transformers (which fuses the experts while loading).

Routing is done one token at a time with Python's sort (ties: lower expert index first), partial
rotary ropes the first ``rotary_dim`` dims in rotate-half pairs and passes the rest through.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hf_reference import Tensors, attention, heads, load, rmsnorm, rotate_half


@dataclass
class MoEForward:
    logits: torch.Tensor  # [T, V]
    layer_inputs: list[torch.Tensor]  # [k] = input of layer k; [n_layer] = the last block's output
    final_hidden: torch.Tensor  # after the final norm
    # per sparse layer, per token: the chosen experts in rank order, and what the choice would be
    # without the selection bias (equal to it for Qwen3-MoE)
    routing: dict[int, list[tuple[int, ...]]]
    routing_unbiased: dict[int, list[tuple[int, ...]]]


def _top_k(scores: list[float], k: int) -> tuple[int, ...]:
    return tuple(sorted(range(len(scores)), key=lambda e: (-scores[e], e))[:k])


def rope_partial(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """HF rope on x [heads, n, hd]: dims [0, rotary_dim) in rotate-half pairs, the rest unchanged."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = positions.double()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rot * emb.cos() + rotate_half(rot) * emb.sin(), rest], dim=-1)


def swiglu(t: Tensors, prefix: str, x: torch.Tensor) -> torch.Tensor:
    g = torch.nn.functional.silu(x @ t[prefix + "gate_proj.weight"].T)
    return (g * (x @ t[prefix + "up_proj.weight"].T)) @ t[prefix + "down_proj.weight"].T


def _is_glm(cfg: dict[str, Any]) -> bool:
    return cfg["model_type"] == "glm4_moe"


def moe_ffn(cfg: dict[str, Any], t: Tensors, p: str, x: torch.Tensor
            ) -> tuple[torch.Tensor, list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The sparse block's FFN over rows x [T, H]: router, top-k experts per token, shared expert.
    Returns (output, chosen experts per token, the choice without the selection bias)."""
    glm = _is_glm(cfg)
    logits = x @ t[p + "mlp.gate.weight"].T
    probs = torch.sigmoid(logits) if glm else torch.softmax(logits, dim=-1)
    choice = probs + t[p + "mlp.gate.e_score_correction_bias"] if glm else probs
    k = cfg["num_experts_per_tok"]
    out = torch.zeros_like(x)
    routing, unbiased = [], []
    for row in range(x.shape[0]):
        chosen = _top_k(choice[row].tolist(), k)
        routing.append(chosen)
        unbiased.append(_top_k(probs[row].tolist(), k))
        w = probs[row, list(chosen)]
        if cfg.get("norm_topk_prob", False):
            w = w / w.sum()
        w = w * cfg.get("routed_scaling_factor", 1.0)
        for e, we in zip(chosen, w.tolist(), strict=True):
            out[row] += we * swiglu(t, f"{p}mlp.experts.{e}.", x[row : row + 1])[0]
    if glm and cfg.get("n_shared_experts", 0):
        out = out + swiglu(t, p + "mlp.shared_experts.", x)
    return out, routing, unbiased


def moe_target_forward(path: Path, tokens: list[int]) -> MoEForward:
    """The trunk of a Qwen3MoeForCausalLM / Glm4MoeForCausalLM checkpoint (MTP layers are not run)."""
    cfg, t = load(path)
    glm = _is_glm(cfg)
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary_dim = int(hd * cfg.get("partial_rotary_factor", 1.0))
    n_dense = cfg.get("first_k_dense_replace", 0) if glm else 0
    ids = torch.tensor(tokens)
    pos = torch.arange(len(tokens))
    causal = torch.tril(torch.ones(len(tokens), len(tokens), dtype=torch.bool))
    x = t["model.embed_tokens.weight"][ids]
    states = [x]
    routing: dict[int, list[tuple[int, ...]]] = {}
    unbiased: dict[int, list[tuple[int, ...]]] = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rmsnorm(x, t[p + "input_layernorm.weight"], eps)
        proj = {n: h @ t[f"{p}self_attn.{n}_proj.weight"].T + t.get(f"{p}self_attn.{n}_proj.bias", 0) for n in "qkv"}
        q, k, v = (heads(proj[n], hd) for n in "qkv")
        if p + "self_attn.q_norm.weight" in t:
            q = rmsnorm(q, t[p + "self_attn.q_norm.weight"], eps)
            k = rmsnorm(k, t[p + "self_attn.k_norm.weight"], eps)
        a = attention(rope_partial(q, pos, theta, rotary_dim), rope_partial(k, pos, theta, rotary_dim), v, causal)
        x = x + a @ t[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, t[p + "post_attention_layernorm.weight"], eps)
        if i < n_dense:
            x = x + swiglu(t, p + "mlp.", h)
        else:
            ffn, routing[i], unbiased[i] = moe_ffn(cfg, t, p, h)
            x = x + ffn
        states.append(x)
    final = rmsnorm(x, t["model.norm.weight"], eps)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return MoEForward(final @ head.T, states, final, routing, unbiased)
