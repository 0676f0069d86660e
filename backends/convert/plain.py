"""Plain decoder checkpoints (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) -> llama/qwen2/qwen3 GGUF.

Used for targets and for draft-simple models. Llama Q/K rows are permuted so llama.cpp's interleaved
rope on them equals HF's rotate_half on the originals (docs/model-formats.md §1.4); Qwen is stored as is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spekula.backends.convert.gguf_writer import GGUFOut, head_dim_known, permute_qk, write_decoder_keys
from spekula.backends.convert.source import HFCheckpoint, need
from spekula.backends.convert.vocab import vocab_flavour, write_vocab
from spekula.core.errors import ModelFileError

PLAIN_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

# HF per-layer suffix -> GGUF per-layer suffix of the attention half, shared by the llama/qwen and
# the MoE (convert/moe.py) converters.
ATTN_MAP: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}

# HF per-layer suffix -> GGUF per-layer suffix (the shared llama/qwen naming).
LAYER_MAP: dict[str, str] = {
    **ATTN_MAP,
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

_REQUIRED = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
             "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def write_layer(out: GGUFOut, ckpt: HFCheckpoint, hf_prefix: str, gguf_prefix: str, *, n_head: int,
                n_head_kv: int, permute: bool, required: tuple[str, ...] = _REQUIRED,
                skip: tuple[str, ...] = ()) -> None:
    """Copy one decoder layer; unknown tensors under the prefix are an error, not silently dropped."""
    for suffix in required:
        if hf_prefix + suffix not in ckpt:
            raise ModelFileError(ckpt.path, f"missing tensor {hf_prefix + suffix!r}")
    for name in ckpt.names():
        if not name.startswith(hf_prefix):
            continue
        suffix = name[len(hf_prefix):]
        if suffix in skip:
            continue
        if suffix not in LAYER_MAP:
            raise ModelFileError(ckpt.path, f"unexpected tensor {name!r} (not a llama/qwen layer weight)")
        data = ckpt.get(name)
        if permute and suffix.startswith("self_attn.q_proj."):
            data = permute_qk(data, n_head)
        elif permute and suffix.startswith("self_attn.k_proj."):
            data = permute_qk(data, n_head_kv)
        out.tensor(gguf_prefix + LAYER_MAP[suffix], data)


def convert_plain(ckpt: HFCheckpoint, outfile: Path, outtype: str, *, pre: str | None) -> Path:
    cfg = ckpt.config
    arch = PLAIN_ARCHS[cfg["architectures"][0]]
    n_layer = int(need(cfg, "num_hidden_layers", ckpt.path))
    n_head = int(need(cfg, "num_attention_heads", ckpt.path))
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    vocab_size = int(need(cfg, "vocab_size", ckpt.path))
    ckpt.require_tensors()
    out = GGUFOut(outfile, arch, outtype)
    try:
        out.w.add_string("general.name", ckpt.path.name)
        write_decoder_keys(out, cfg, n_layer=n_layer, where=ckpt.path, llama_style=arch == "llama",
                           head_dim_keys=head_dim_known(cfg, cfg))
        write_vocab(out, ckpt.path, vocab_size=vocab_size, pre=pre, flavour=vocab_flavour(cfg))
        emb = ckpt.get("model.embed_tokens.weight")
        if emb.shape != (vocab_size, int(cfg["hidden_size"])):
            raise ModelFileError(ckpt.path, f"embed_tokens shape {emb.shape} != (vocab_size, hidden_size)")
        out.tensor("token_embd.weight", emb)
        out.tensor("output_norm.weight", ckpt.get("model.norm.weight"))
        tied = bool(cfg.get("tie_word_embeddings", False))
        if "lm_head.weight" in ckpt and not tied:
            out.tensor("output.weight", ckpt.get("lm_head.weight"))
        elif "lm_head.weight" not in ckpt and not tied:
            raise ModelFileError(ckpt.path, "missing tensor 'lm_head.weight' (and tie_word_embeddings is false)")
        required = _REQUIRED + (("self_attn.q_norm.weight", "self_attn.k_norm.weight") if arch == "qwen3" else ())
        for i in range(n_layer):
            write_layer(out, ckpt, f"model.layers.{i}.", f"blk.{i}.", n_head=n_head, n_head_kv=n_head_kv,
                        permute=arch == "llama", required=required,
                        skip=("self_attn.rotary_emb.inv_freq",))
        extra = [n for n in ckpt.names() if not n.startswith("model.layers.")
                 and n not in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")]
        if extra:
            raise ModelFileError(ckpt.path, f"unexpected tensors {extra[:5]}")
        beyond = [n for n in ckpt.names() if n.startswith(f"model.layers.{n_layer}.")]
        if beyond:
            raise ModelFileError(ckpt.path, f"tensors beyond num_hidden_layers={n_layer}: {beyond[:3]}")
        return out.finish()
    except BaseException:
        out.abort()
        raise


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk` (GGUF rows -> HF rows); used by tests and loaders that want NEOX."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
