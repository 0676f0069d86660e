"""Plain float64 references of Hugging Face's Qwen3-MoE and GLM-4.5-MoE decoders, written from their
configs and per-expert checkpoint tensors (``mlp.experts.E.*``), a different code path from both the
GGUF runtimes (which read stacked ``ffn_*_exps`` tensors and run experts as grouped GEMMs) and
transformers (which fuses the experts while loading).

Routing is done one token at a time with Python's sort (ties: lower expert index first), partial
rotary ropes the first ``rotary_dim`` dims in rotate-half pairs and passes the rest through
(hf_reference's rope and self-attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hf_reference import Tensors, head_dim, load, rmsnorm, self_attention, swiglu


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


def moe_decoder_layer(cfg: dict[str, Any], t: Tensors, layer: int, x: torch.Tensor
                      ) -> tuple[torch.Tensor, list[tuple[int, ...]] | None, list[tuple[int, ...]] | None]:
    """Decoder layer ``layer`` of a Qwen3MoeForCausalLM / Glm4MoeForCausalLM checkpoint over rows x [T, H] at
    positions 0..T-1: (output, chosen experts per token, the choice without the selection bias); the
    choices are None for GLM's dense lead layers."""
    p = f"model.layers.{layer}."
    rotary_dim = int(head_dim(cfg) * cfg.get("partial_rotary_factor", 1.0))
    x = self_attention(cfg, t, p, x, rotary_dim)
    h = rmsnorm(x, t[p + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    if _is_glm(cfg) and layer < cfg.get("first_k_dense_replace", 0):
        return x + swiglu(t, p + "mlp.", h), None, None
    ffn, routing, unbiased = moe_ffn(cfg, t, p, h)
    return x + ffn, routing, unbiased


def moe_target_forward(path: Path, tokens: list[int]) -> MoEForward:
    """The trunk of a Qwen3MoeForCausalLM / Glm4MoeForCausalLM checkpoint (MTP layers are not run)."""
    cfg, t = load(path)
    x = t["model.embed_tokens.weight"][torch.tensor(tokens)]
    states = [x]
    routing: dict[int, list[tuple[int, ...]]] = {}
    unbiased: dict[int, list[tuple[int, ...]]] = {}
    for i in range(cfg["num_hidden_layers"]):
        x, chosen, plain = moe_decoder_layer(cfg, t, i, x)
        if chosen is not None and plain is not None:
            routing[i], unbiased[i] = chosen, plain
        states.append(x)
    final = rmsnorm(x, t["model.norm.weight"], cfg["rms_norm_eps"])
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return MoEForward(final @ head.T, states, final, routing, unbiased)
