"""Synthetic Qwen3.5-shaped hybrid GGUFs (0.8B and 4B) in Q4_K_M, for hybrid-model speed and memory.

The shapes of Qwen3.5-0.8B (hidden 1024, 24 blocks, every 4th full attention with 8 query / 2 key-value
heads of 256, gated delta-net blocks with 16 key and 16 value heads of 128, feed-forward 3584) and
Qwen3.5-4B (hidden 2560, 32 blocks, 16 / 4 attention heads of 256, 16 key and 32 value heads of 128,
feed-forward 9216), vocabulary 248320, tied output, one MTP block after the trunk as the real files
carry. Random weights: the text is noise, but every projection, conv, recurrent state, cache and head
has a real model's size. The F16 file is written with the fixture writer and quantized to Q4_K_M by
llama.cpp's own `llama-quantize`, so the block mix is what llama.cpp users run. Cached under
~/.cache/spekula/bench/.

`--dense-twin` writes the hybrid's dense twin instead: a qwen3 file of the same hidden size, depth,
feed-forward and attention heads with every block full attention (no gate, no MTP block), about the
same bytes, to set what speculation gives on a hybrid model against what it gives on a dense one.

    .venv/bin/python bench/synthetic_qwen35.py [--size 0.8b|4b] [--dense-twin] [--llama-server PATH]   # prints the path
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from synthetic_model import _tokenizer_meta, llama_server_binary, quantized_q4_k_m

SHAPES: dict[str, dict[str, int]] = {
    "0.8b": {"n_embd": 1024, "n_layer": 24, "n_head": 8, "n_head_kv": 2, "head_dim": 256, "n_ff": 3584,
             "n_k_heads": 16, "n_v_heads": 16, "head_k_dim": 128, "head_v_dim": 128},
    "4b": {"n_embd": 2560, "n_layer": 32, "n_head": 16, "n_head_kv": 4, "head_dim": 256, "n_ff": 9216,
           "n_k_heads": 16, "n_v_heads": 32, "head_k_dim": 128, "head_v_dim": 128},
}
VOCAB = 248320
CONV_KERNEL = 4
INTERVAL = 4  # every 4th block is full attention
N_ROT = 64  # partial rotary: a quarter of the 256-dim heads


def name(size: str, dense_twin: bool = False) -> str:
    return f"synthetic-{'qwen3-twin' if dense_twin else 'qwen35'}-{size}"


def write_f16(path: Path, size: str, seed: int = 0, dense_twin: bool = False) -> Path:
    from spekula.fixtures.tiny_gguf import write_gguf

    s = SHAPES[size]
    rng = np.random.default_rng(seed)
    E, hd, nh, nkv, ff = s["n_embd"], s["head_dim"], s["n_head"], s["n_head_kv"], s["n_ff"]
    n_k, n_v, dk, dv = s["n_k_heads"], s["n_v_heads"], s["head_k_dim"], s["head_v_dim"]
    key_dim, value_dim = n_k * dk, n_v * dv
    conv_dim = 2 * key_dim + value_dim

    def mat(rows: int, cols: int) -> tuple[np.ndarray, str]:
        out = np.empty((rows, cols), np.float16)
        for r in range(0, rows, 65536):
            out[r : r + 65536] = rng.standard_normal((min(65536, rows - r), cols), dtype=np.float32) / np.sqrt(cols)
        return out, "F16"

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    def attention(b: str) -> dict[str, object]:
        return {b + "attn_q.weight": mat((1 if dense_twin else 2) * nh * hd, E), b + "attn_k.weight": mat(nkv * hd, E),
                b + "attn_v.weight": mat(nkv * hd, E), b + "attn_output.weight": mat(E, nh * hd),
                b + "attn_q_norm.weight": ones(hd), b + "attn_k_norm.weight": ones(hd)}

    def dense_block(b: str) -> dict[str, object]:
        return {b + "attn_norm.weight": ones(E), b + ("ffn_norm" if dense_twin else "post_attention_norm") + ".weight": ones(E),
                b + "ffn_gate.weight": mat(ff, E), b + "ffn_up.weight": mat(ff, E), b + "ffn_down.weight": mat(E, ff)}

    tensors: dict[str, object] = {"token_embd.weight": mat(VOCAB, E), "output_norm.weight": ones(E)}
    if dense_twin:
        for i in range(s["n_layer"]):
            tensors |= dense_block(f"blk.{i}.") | attention(f"blk.{i}.")
        hparams = {"context_length": 262144, "embedding_length": E, "block_count": s["n_layer"],
                   "feed_forward_length": ff, "attention.head_count": nh, "attention.head_count_kv": nkv,
                   "attention.key_length": hd, "attention.value_length": hd, "rope.freq_base": 10000000.0,
                   "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": VOCAB}
        meta = {"general.name": f"spekula synthetic dense twin of Qwen3.5-{size.upper()} (random weights)",
                "general.file_type": 1, **_tokenizer_meta(VOCAB)}
        return write_gguf(path, "qwen3", hparams, tensors, meta)  # type: ignore[arg-type]
    for i in range(s["n_layer"]):
        b = f"blk.{i}."
        tensors |= dense_block(b)
        if (i + 1) % INTERVAL == 0:
            tensors |= attention(b)
        else:
            tensors |= {
                b + "attn_qkv.weight": mat(conv_dim, E), b + "attn_gate.weight": mat(value_dim, E),
                b + "ssm_conv1d.weight": (rng.standard_normal((conv_dim, CONV_KERNEL), dtype=np.float32) * 0.5),
                b + "ssm_dt.bias": rng.standard_normal(n_v, dtype=np.float32),
                b + "ssm_a": -rng.uniform(1.0, 16.0, n_v).astype(np.float32),  # -exp(A_log)
                b + "ssm_beta.weight": mat(n_v, E), b + "ssm_alpha.weight": mat(n_v, E),
                b + "ssm_norm.weight": ones(dv), b + "ssm_out.weight": mat(E, value_dim),
            }
    mtp = f"blk.{s['n_layer']}."
    tensors |= dense_block(mtp) | attention(mtp) | {
        mtp + "nextn.eh_proj.weight": mat(E, 2 * E), mtp + "nextn.enorm.weight": ones(E),
        mtp + "nextn.hnorm.weight": ones(E), mtp + "nextn.shared_head_norm.weight": ones(E)}
    hparams = {"context_length": 262144, "embedding_length": E, "block_count": s["n_layer"] + 1,
               "nextn_predict_layers": 1, "feed_forward_length": ff, "attention.head_count": nh,
               "attention.head_count_kv": nkv, "attention.key_length": hd, "attention.value_length": hd,
               "rope.freq_base": 10000000.0, "rope.dimension_count": N_ROT, "rope.dimension_sections": [11, 11, 10, 0],
               "attention.layer_norm_rms_epsilon": 1e-6, "ssm.conv_kernel": CONV_KERNEL,
               "ssm.inner_size": value_dim, "ssm.state_size": dk, "ssm.time_step_rank": n_v, "ssm.group_count": n_k,
               "full_attention_interval": INTERVAL, "vocab_size": VOCAB}
    meta = {"general.name": f"spekula synthetic Qwen3.5-{size.upper()}-shaped hybrid (random weights)",
            "general.file_type": 1, **_tokenizer_meta(VOCAB)}
    return write_gguf(path, "qwen35", hparams, tensors, meta)  # type: ignore[arg-type]


def synthetic_qwen35(size: str, llama_server: str | None, dense_twin: bool = False) -> Path:
    """The cached Q4_K_M file of `size`, built on first use with the llama-quantize next to `llama_server`."""
    return quantized_q4_k_m(name(size, dense_twin), lambda p: write_f16(p, size, dense_twin=dense_twin), llama_server)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SHAPES), default="0.8b")
    p.add_argument("--dense-twin", action="store_true", help="the dense qwen3 twin of that size instead")
    p.add_argument("--llama-server", metavar="PATH")
    args = p.parse_args()
    print(synthetic_qwen35(args.size, llama_server_binary(args.llama_server), args.dense_twin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
