"""A synthetic Qwen3-30B-A3B-shaped MoE GGUF (4 blocks) in Q4_K_M, for MoE speed and memory.

The layer shapes of Qwen3-30B-A3B (hidden 2048, 32 query / 4 key-value heads of 128 with q/k norm,
128 experts of feed-forward 768 with 8 used per token, vocabulary 151936, untied output) at 4 of its
48 blocks, random weights: the text is noise, but every router, expert matmul, cache and head has a
real model's size. About 2.4 B parameters on disk, ~0.5 B touched per token. The F16 file is written
with the fixture writer and quantized to Q4_K_M by llama.cpp's own `llama-quantize`, so the block mix
is what llama.cpp users run. Cached under ~/.cache/spekula/bench/.

    .venv/bin/python bench/synthetic_moe.py [--llama-server PATH]   # prints the path
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from synthetic_model import _tokenizer_meta, build_cli, quantized_q4_k_m

SHAPE = {"n_embd": 2048, "n_layer": 4, "n_head": 32, "n_head_kv": 4, "head_dim": 128, "n_expert": 128,
         "n_expert_used": 8, "n_ff_exp": 768, "vocab": 151936}
NAME = "synthetic-qwen3moe-30b-a3b-L4"


def write_f16(path: Path, seed: int = 0) -> Path:
    from spekula.fixtures.tiny_gguf import write_gguf

    s = SHAPE
    rng = np.random.default_rng(seed)
    E, hd, nh, nkv = s["n_embd"], s["head_dim"], s["n_head"], s["n_head_kv"]
    X, F = s["n_expert"], s["n_ff_exp"]

    def mat(*shape: int) -> tuple[np.ndarray, str]:
        # Drawn in float32 slices to bound the peak memory of the 3-D expert tensors.
        out = np.empty(shape, np.float16)
        flat = out.reshape(-1, shape[-1])
        for r in range(0, flat.shape[0], 65536):
            flat[r : r + 65536] = rng.standard_normal((min(65536, flat.shape[0] - r), shape[-1]),
                                                      dtype=np.float32) / np.sqrt(shape[-1])
        return out, "F16"

    ones = np.ones(E, np.float32)
    tensors: dict[str, object] = {"token_embd.weight": mat(s["vocab"], E), "output.weight": mat(s["vocab"], E),
                                  "output_norm.weight": ones}
    for i in range(s["n_layer"]):
        b = f"blk.{i}."
        tensors |= {
            b + "attn_norm.weight": ones, b + "attn_q.weight": mat(nh * hd, E), b + "attn_k.weight": mat(nkv * hd, E),
            b + "attn_v.weight": mat(nkv * hd, E), b + "attn_output.weight": mat(E, nh * hd),
            b + "attn_q_norm.weight": np.ones(hd, np.float32), b + "attn_k_norm.weight": np.ones(hd, np.float32),
            b + "ffn_norm.weight": ones,
            # A router with a wide spread of logits, so tokens really go to different experts.
            b + "ffn_gate_inp.weight": rng.standard_normal((X, E), dtype=np.float32),
            b + "ffn_gate_exps.weight": mat(X, F, E), b + "ffn_up_exps.weight": mat(X, F, E),
            b + "ffn_down_exps.weight": mat(X, E, F),
        }
    hparams = {"context_length": 8192, "embedding_length": E, "block_count": s["n_layer"],
               "feed_forward_length": 6144, "attention.head_count": nh, "attention.head_count_kv": nkv,
               "attention.key_length": hd, "attention.value_length": hd, "rope.freq_base": 1000000.0,
               "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": X, "expert_used_count": s["n_expert_used"],
               "expert_feed_forward_length": F, "vocab_size": s["vocab"]}
    meta = {"general.name": "spekula synthetic Qwen3-30B-A3B-shaped MoE, 4 blocks (random weights)",
            "general.file_type": 1, **_tokenizer_meta(s["vocab"])}
    return write_gguf(path, "qwen3moe", hparams, tensors, meta)  # type: ignore[arg-type]


def synthetic_moe(llama_server: str | None) -> Path:
    """The cached Q4_K_M file, built on first use with the llama-quantize next to `llama_server`."""
    return quantized_q4_k_m(NAME, write_f16, llama_server)


if __name__ == "__main__":
    sys.exit(build_cli(__doc__.split("\n\n")[0], synthetic_moe))
