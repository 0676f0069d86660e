"""Plain PyTorch references of the Hugging Face formulations (HF tensor names, rotate_half rope on
un-permuted weights, d2t offsets), deliberately a different code path from the GGUF runtimes.

Used by the converter round-trip tests: HF checkpoint -> reference logits must equal
HF checkpoint -> `spekula convert` -> GGUF -> runtime logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

Tensors = dict[str, torch.Tensor]


def load(path: Path) -> tuple[dict[str, Any], Tensors]:
    cfg = json.loads((path / "config.json").read_text())
    if isinstance(cfg.get("transformer_layer_config"), dict):
        cfg = {**cfg, **cfg["transformer_layer_config"]}
    t = load_file(str(path / "model.safetensors"))
    return cfg, {k: v.double() if v.is_floating_point() else v for k, v in t.items()}


def rmsnorm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None = None) -> torch.Tensor:
    """x [heads, n, hd] with HF's cos/sin tables: dims [0, rotary_dim) (all by default) in rotate_half
    pairs i, i + rotary_dim/2, the rest unchanged (partial rotary)."""
    rd = x.shape[-1] if rotary_dim is None else rotary_dim
    inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    freqs = positions.double()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * emb.cos() + rotate_half(rot) * emb.sin(), rest], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [Hq, n, hd], k/v [Hkv, L, hd] -> [n, Hq*hd]; mask [n, L] True = allowed."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    o = torch.softmax(s, -1) @ v
    return o.transpose(0, 1).reshape(q.shape[1], -1)


def swiglu(t: Tensors, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP ``prefix{gate,up,down}_proj`` over rows x."""
    g = torch.nn.functional.silu(x @ t[prefix + "gate_proj.weight"].T)
    return (g * (x @ t[prefix + "up_proj.weight"].T)) @ t[prefix + "down_proj.weight"].T


def mlp(t: Tensors, p: str, x: torch.Tensor) -> torch.Tensor:
    return swiglu(t, p + "mlp.", x)


def heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    return x.view(x.shape[0], -1, hd).transpose(0, 1)


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def self_attention(cfg: dict[str, Any], t: Tensors, p: str, x: torch.Tensor,
                   rotary_dim: int | None = None) -> torch.Tensor:
    """x plus the self-attention of decoder layer ``p`` over rows x [T, H] at positions 0..T-1, causal:
    input_layernorm, q/k/v (with their biases and q/k norms when the checkpoint has them), rope, o_proj."""
    eps, theta, hd = cfg["rms_norm_eps"], cfg["rope_theta"], head_dim(cfg)
    pos = torch.arange(x.shape[0])
    causal = torch.tril(torch.ones(x.shape[0], x.shape[0], dtype=torch.bool))
    h = rmsnorm(x, t[p + "input_layernorm.weight"], eps)
    proj = {n: h @ t[f"{p}self_attn.{n}_proj.weight"].T + t.get(f"{p}self_attn.{n}_proj.bias", 0) for n in "qkv"}
    q, k, v = (heads(proj[n], hd) for n in "qkv")
    if p + "self_attn.q_norm.weight" in t:
        q = rmsnorm(q, t[p + "self_attn.q_norm.weight"], eps)
        k = rmsnorm(k, t[p + "self_attn.k_norm.weight"], eps)
    a = attention(rope(q, pos, theta, rotary_dim), rope(k, pos, theta, rotary_dim), v, causal)
    return x + a @ t[p + "self_attn.o_proj.weight"].T


def target_forward(path: Path, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """HF Llama/Qwen2/Qwen3 forward: (logits [T, V], hidden_states list: [k] = input of layer k)."""
    cfg, t = load(path)
    eps = cfg["rms_norm_eps"]
    x = t["model.embed_tokens.weight"][torch.tensor(tokens)]
    states = [x]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = self_attention(cfg, t, p, x)
        x = x + mlp(t, p, rmsnorm(x, t[p + "post_attention_layernorm.weight"], eps))
        states.append(x)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return rmsnorm(x, t["model.norm.weight"], eps) @ head.T, states


def _find(t: Tensors, *names: str) -> torch.Tensor | None:
    return next((t[n] for n in names if n in t), None)


def _scatter(z: torch.Tensor, d2t: torch.Tensor | None, n_vocab: int, fill: float) -> torch.Tensor:
    if d2t is None:
        return z
    ids = torch.arange(d2t.numel()) + d2t.long()  # HF offsets -> target ids
    out = torch.full((z.shape[0], n_vocab), fill, dtype=z.dtype)
    out[:, ids] = z
    return out


def eagle3_forward(draft: Path, target: Path, features: torch.Tensor, tokens: list[int],
                   start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge/vLLM EAGLE-3 over rows (tokens[k], fc(features[k])) at positions start+k, causal over these rows.

    Returns (logits [T, V] with -inf outside the draft vocabulary, pre-norm hidden [T, H]).
    """
    cfg, t = _eagle3_tensors(draft)
    f = features.double()
    if cfg.get("norm_before_fc"):
        f = rmsnorm(f, t["input_norm.weight"], cfg["rms_norm_eps"])
    return eagle3_layer(draft, target, f @ t["fc.weight"].T, tokens, start)


def _eagle3_tensors(draft: Path) -> tuple[dict[str, Any], Tensors]:
    cfg, t = load(draft)
    return cfg, {k.removeprefix("model.") if not k.startswith("model.layers.") else k: v for k, v in t.items()}


def eagle3_layer(draft: Path, target: Path, g: torch.Tensor, tokens: list[int],
                 start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-3 decoder layer and head over rows (tokens[k], g[k]); g is fc output or a previous pre-norm."""
    cfg, t = _eagle3_tensors(draft)
    tcfg, tt = load(target)
    prefix = next(p for p in ("midlayer.", "model.layers.0.", "layers.0.") if any(k.startswith(p) for k in t))
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    g = g.double()
    embed = _find(t, "embed_tokens.weight")
    embed = tt["model.embed_tokens.weight"] if embed is None else embed
    e = rmsnorm(embed[torch.tensor(tokens)], t[prefix + "input_layernorm.weight"], eps)
    gn = rmsnorm(g, t[prefix + "hidden_norm.weight"], eps)
    x = torch.cat([e, gn], dim=-1)
    n = len(tokens)
    pos = torch.arange(start, start + n)
    q, k, v = (heads(x @ t[f"{prefix}self_attn.{c}_proj.weight"].T, hd) for c in "qkv")
    a = attention(rope(q, pos, theta), rope(k, pos, theta), v, torch.tril(torch.ones(n, n, dtype=torch.bool)))
    h = a @ t[prefix + "self_attn.o_proj.weight"].T + (gn if cfg.get("norm_before_residual") else g)
    h = h + mlp(t, prefix, rmsnorm(h, t[prefix + "post_attention_layernorm.weight"], eps))
    head = _find(t, "lm_head.weight")
    normed = rmsnorm(h, t["norm.weight"], eps)
    if head is None:
        logits = normed @ tt.get("lm_head.weight", tt["model.embed_tokens.weight"]).T
    else:
        logits = _scatter(normed @ head.T, t.get("d2t"), tcfg["vocab_size"], float("-inf"))
    return logits, h


def dflash_forward(draft: Path, target: Path, ctx_features: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """z-lab DFlash: block at positions P.. over context features at 0..P-1 (P = len(ctx_features)).

    K/V = cat(proj(ctx), proj(noise)); k_norm over both; rope over the concatenated positions;
    non-causal. Returns (base logits [B, V], post-norm hidden [B, H]).
    """
    cfg, t = load(draft)
    tcfg, tt = load(target)
    t = {k.removeprefix("model."): v for k, v in t.items()}
    dcfg = {**cfg, **cfg.get("dflash_config", {})}
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    c = rmsnorm(ctx_features.double() @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    P, B = c.shape[0], len(block)
    pos = torch.arange(P + B)
    x = tt["model.embed_tokens.weight"][torch.tensor(block)]
    causal = bool(dcfg.get("is_causal", dcfg.get("causal", False)))
    mask = None
    if causal:
        mask = torch.ones(B, P + B, dtype=torch.bool)
        mask[:, P:] = torch.tril(torch.ones(B, B, dtype=torch.bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rmsnorm(x, t[p + "input_layernorm.weight"], eps)
        q = rmsnorm(heads(h @ t[p + "self_attn.q_proj.weight"].T, hd), t[p + "self_attn.q_norm.weight"], eps)
        kin = torch.cat([c, h])
        k = rmsnorm(heads(kin @ t[p + "self_attn.k_proj.weight"].T, hd), t[p + "self_attn.k_norm.weight"], eps)
        v = heads(kin @ t[p + "self_attn.v_proj.weight"].T, hd)
        a = attention(rope(q, pos[P:], theta), rope(k, pos, theta), v, mask)
        x = x + a @ t[p + "self_attn.o_proj.weight"].T
        x = x + mlp(t, p, rmsnorm(x, t[p + "post_attention_layernorm.weight"], eps))
    hid = rmsnorm(x, t["norm.weight"], eps)
    own = _find(t, "lm_head.weight")
    if own is not None and "d2t" in t:
        return _scatter(hid @ own.T, t["d2t"], tcfg["vocab_size"], float("-inf")), hid
    head = own if own is not None else tt.get("lm_head.weight", tt["model.embed_tokens.weight"])
    return hid @ head.T, hid


def dspark_forward(draft: Path, target: Path, ctx_features: torch.Tensor, block: list[int],
                   anchor_first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DSpark: DFlash logits plus the vanilla Markov bias chained greedily; (logits [B, V], confidence [B] or None)."""
    cfg, t = load(draft)
    tcfg, _ = load(target)
    t = {k.removeprefix("model."): v for k, v in t.items()}
    base, hid = dflash_forward(draft, target, ctx_features, block)
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    proj_w, proj_b = t.get("confidence_head.proj.weight"), t.get("confidence_head.proj.bias")
    d2t = t.get("d2t")
    out = base.clone()
    conf = torch.ones(len(block), dtype=torch.float64) if proj_w is not None else None
    prev = block[0]
    for i in range(0 if anchor_first else 1, len(block)):
        u = w1[prev]
        out[i] = base[i] + _scatter((w2 @ u)[None], d2t, tcfg["vocab_size"], 0.0)[0]
        if conf is not None and proj_w is not None:
            conf[i] = torch.sigmoid(proj_w @ torch.cat([hid[i], u]) + (proj_b if proj_b is not None else 0))[0]
        prev = int(out[i].argmax())
    return out, conf
