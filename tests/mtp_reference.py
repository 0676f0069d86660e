"""A float64 reference of GLM-4.5's MTP layers from the Hugging Face checkpoint (HF tensor names, per-expert
weights, rotate-half partial rope): a different code path from the GGUF runtime it checks.

Entry P of head k pairs token x_P with a hidden state h: u = eh_proj [enorm(E x_P); hnorm(h)], then the
MTP layer's decoder block (causal over all entries), shared_head.norm and shared_head.head; the layer's
own embed_tokens / shared_head tensors when the checkpoint has them, else the trunk's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hf_moe_reference import moe_ffn, rope_partial, swiglu
from hf_reference import attention, heads, load, rmsnorm


def decoder_layer(path: Path, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Layer ``layer`` of a Glm4MoeForCausalLM checkpoint over rows x [T, H] at positions 0..T-1."""
    cfg, t = load(path)
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary_dim = int(hd * cfg.get("partial_rotary_factor", 1.0))
    pos = torch.arange(x.shape[0])
    causal = torch.tril(torch.ones(x.shape[0], x.shape[0], dtype=torch.bool))
    p = f"model.layers.{layer}."
    h = rmsnorm(x, t[p + "input_layernorm.weight"], eps)
    proj = {n: h @ t[f"{p}self_attn.{n}_proj.weight"].T + t.get(f"{p}self_attn.{n}_proj.bias", 0) for n in "qkv"}
    q, k, v = (heads(proj[n], hd) for n in "qkv")
    if p + "self_attn.q_norm.weight" in t:
        q = rmsnorm(q, t[p + "self_attn.q_norm.weight"], eps)
        k = rmsnorm(k, t[p + "self_attn.k_norm.weight"], eps)
    a = attention(rope_partial(q, pos, theta, rotary_dim), rope_partial(k, pos, theta, rotary_dim), v, causal)
    x = x + a @ t[p + "self_attn.o_proj.weight"].T
    h = rmsnorm(x, t[p + "post_attention_layernorm.weight"], eps)
    if layer < cfg.get("first_k_dense_replace", 0):
        return x + swiglu(t, p + "mlp.", h)
    return x + moe_ffn(cfg, t, p, h)[0]


def mtp_forward(path: Path, head: int, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], hout [T, H]) of MTP head ``head`` over entries (tokens[P], hidden[P]) at P = 0..T-1."""
    cfg, t = load(path)
    eps = cfg["rms_norm_eps"]
    layer = cfg["num_hidden_layers"] + head
    p = f"model.layers.{layer}."
    embd = t.get(p + "embed_tokens.weight", t["model.embed_tokens.weight"])
    e = rmsnorm(embd[torch.tensor(tokens)], t[p + "enorm.weight"], eps)
    u = torch.cat([e, rmsnorm(hidden.double(), t[p + "hnorm.weight"], eps)], dim=-1) @ t[p + "eh_proj.weight"].T
    hout = rmsnorm(decoder_layer(path, layer, u), t.get(p + "shared_head.norm.weight", t["model.norm.weight"]), eps)
    return hout @ t.get(p + "shared_head.head.weight", t["lm_head.weight"]).T, hout
