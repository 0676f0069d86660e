"""A float64 reference of GLM-4.5's MTP layers from the Hugging Face checkpoint (HF tensor names, per-expert
weights, rotate-half partial rope): a different code path from the GGUF runtime it checks.

Entry P of head k pairs token x_P with a hidden state h: u = eh_proj [enorm(E x_P); hnorm(h)], then the
MTP layer's decoder block (causal over all entries), shared_head.norm and shared_head.head; the layer's
own embed_tokens / shared_head tensors when the checkpoint has them, else the trunk's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hf_moe_reference import moe_decoder_layer
from hf_reference import load, rmsnorm


def mtp_forward(path: Path, head: int, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], hout [T, H]) of MTP head ``head`` over entries (tokens[P], hidden[P]) at P = 0..T-1."""
    cfg, t = load(path)
    eps = cfg["rms_norm_eps"]
    layer = cfg["num_hidden_layers"] + head
    p = f"model.layers.{layer}."
    embd = t.get(p + "embed_tokens.weight", t["model.embed_tokens.weight"])
    e = rmsnorm(embd[torch.tensor(tokens)], t[p + "enorm.weight"], eps)
    u = torch.cat([e, rmsnorm(hidden.double(), t[p + "hnorm.weight"], eps)], dim=-1) @ t[p + "eh_proj.weight"].T
    hout = rmsnorm(moe_decoder_layer(cfg, t, layer, u)[0], t.get(p + "shared_head.norm.weight", t["model.norm.weight"]), eps)
    return hout @ t.get(p + "shared_head.head.weight", t["lm_head.weight"]).T, hout
