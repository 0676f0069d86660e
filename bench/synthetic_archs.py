"""Synthetic GGUFs in the shapes of Gemma 3 270M, Ministral 3 3B and gpt-oss-20b, for speed and memory
against llama-server on the architectures that real files of those models use.

No real file of these models can be downloaded here, so each is written with its real widths,
heads, vocabulary and the keys its converter writes, with random weights (the text is noise, but
every matmul, window, cache and head has the real model's size), in F16, then quantized by llama.cpp's
own ``llama-quantize`` so the block mix is what llama.cpp users run:

* ``gemma3-270m``: Gemma 3 270M whole (hidden 640, 18 blocks, 4 query / 1 key-value heads of 256,
  feed-forward 2048, window 512 on five blocks of six, vocabulary 262144, tied output). Its 640-wide
  rows are not a multiple of 256, so llama-quantize stores most of a Q4_K_M file as Q5_0 / Q8_0 and an
  IQ4_XS one as IQ4_NL, as it does for the real file.
* ``ministral3-3b``: Ministral 3 3B's widths (hidden 3072, 32 / 8 heads of 128, feed-forward 9216,
  vocabulary 131072, tied output, YaRN x16 over 16384 and the queries' temperature) at 6 of its 26
  blocks, to keep a run short; about 1.1 B parameters.
* ``gpt-oss-20b``: gpt-oss-20b's widths (hidden 2880, 64 / 8 heads of 64 with sinks and biases, 32
  experts of 2880 with 4 used, window 128 on every other block, YaRN x32 over 4096, vocabulary 201088,
  untied output) at 2 of its 24 blocks; quantized with MXFP4_MOE (experts MXFP4, the rest Q8_0), the
  type the published files use.
* ``gemma4-1b``: skipped with a message saying why: no writer for Gemma 4's shape yet (per-layer
  token embeddings, KV shared by the last blocks, per-block head sizes), nor, before it, the architecture.

Cached under ~/.cache/spekula/bench/ as ``synthetic-<shape>-<MIX>.gguf``.

    .venv/bin/python bench/synthetic_archs.py SHAPE [--mix Q4_K_M] [--llama-server PATH]   # prints the path
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from synthetic_model import _tokenizer_meta, llama_server_binary, quantized

Tensors = dict[str, object]


class _Draw:
    """Random F16 matrices (scaled by 1/sqrt(fan-in)) drawn in float32 slices to bound memory."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def mat(self, *shape: int) -> tuple[np.ndarray, str]:
        out = np.empty(shape, np.float16)
        flat = out.reshape(-1, shape[-1])
        for r in range(0, flat.shape[0], 65536):
            n = min(65536, flat.shape[0] - r)
            flat[r : r + n] = self.rng.standard_normal((n, shape[-1]), dtype=np.float32) / np.sqrt(shape[-1])
        return out, "F16"

    def small(self, *shape: int, scale: float = 0.02) -> np.ndarray:
        return (self.rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, np.float32)


def _attention(d: _Draw, b: str, E: int, nh: int, nkv: int, hd: int) -> Tensors:
    return {b + "attn_q.weight": d.mat(nh * hd, E), b + "attn_k.weight": d.mat(nkv * hd, E),
            b + "attn_v.weight": d.mat(nkv * hd, E), b + "attn_output.weight": d.mat(E, nh * hd)}


def _ffn(d: _Draw, b: str, E: int, ff: int) -> Tensors:
    return {b + "ffn_gate.weight": d.mat(ff, E), b + "ffn_up.weight": d.mat(ff, E), b + "ffn_down.weight": d.mat(E, ff)}


def write_gemma3_270m(path: Path, seed: int = 0) -> Path:
    from spekula.fixtures.tiny_gguf import write_gguf

    E, L, nh, nkv, hd, ff, V = 640, 18, 4, 1, 256, 2048, 262144
    d = _Draw(seed)
    tensors: Tensors = {"token_embd.weight": d.mat(V, E), "output_norm.weight": _ones(E)}
    for i in range(L):
        b = f"blk.{i}."
        tensors |= _attention(d, b, E, nh, nkv, hd) | _ffn(d, b, E, ff) | {
            b + "attn_norm.weight": _ones(E), b + "ffn_norm.weight": _ones(E),
            b + "post_attention_norm.weight": _ones(E), b + "post_ffw_norm.weight": _ones(E),
            b + "attn_q_norm.weight": _ones(hd), b + "attn_k_norm.weight": _ones(hd)}
    hparams = {"context_length": 32768, "embedding_length": E, "block_count": L, "feed_forward_length": ff,
               "attention.head_count": nh, "attention.head_count_kv": nkv, "attention.key_length": hd,
               "attention.value_length": hd, "rope.freq_base": 1000000.0, "rope.freq_base_swa": 10000.0,
               "attention.layer_norm_rms_epsilon": 1e-6, "attention.sliding_window": 512}
    meta = {"general.name": "spekula synthetic Gemma-3-270M-shaped model (random weights)", "general.file_type": 1,
            **_tokenizer_meta(V)}
    return write_gguf(path, "gemma3", hparams, tensors, meta)  # type: ignore[arg-type]


MINISTRAL3_BLOCKS = 6  # of 26: the widths are real, the depth cut for the run's time


def write_ministral3_3b(path: Path, seed: int = 0) -> Path:
    from spekula.fixtures.tiny_gguf import llama_permute, write_gguf

    E, L, nh, nkv, hd, ff, V = 3072, MINISTRAL3_BLOCKS, 32, 8, 128, 9216, 131072
    d = _Draw(seed)
    tensors: Tensors = {"token_embd.weight": d.mat(V, E), "output_norm.weight": _ones(E)}
    for i in range(L):
        b = f"blk.{i}."
        block = _attention(d, b, E, nh, nkv, hd)
        # The converter permutes q/k rows for llama's interleaved rope; done here too, so the file is one it writes.
        block[b + "attn_q.weight"] = (llama_permute(block[b + "attn_q.weight"][0], nh), "F16")  # type: ignore[index]
        block[b + "attn_k.weight"] = (llama_permute(block[b + "attn_k.weight"][0], nkv), "F16")  # type: ignore[index]
        tensors |= block | _ffn(d, b, E, ff) | {b + "attn_norm.weight": _ones(E), b + "ffn_norm.weight": _ones(E)}
    hparams = {"context_length": 262144, "embedding_length": E, "block_count": L, "feed_forward_length": ff,
               "attention.head_count": nh, "attention.head_count_kv": nkv, "attention.key_length": hd,
               "attention.value_length": hd, "rope.dimension_count": hd, "rope.freq_base": 1000000.0,
               "rope.scaling.type": "yarn", "rope.scaling.factor": 16.0,
               "rope.scaling.original_context_length": 16384, "rope.scaling.yarn_beta_fast": 32.0,
               "rope.scaling.yarn_beta_slow": 1.0, "rope.scaling.yarn_log_multiplier": 1.0,
               "attention.temperature_scale": 0.1, "attention.layer_norm_rms_epsilon": 1e-5, "vocab_size": V}
    meta = {"general.name": f"spekula synthetic Ministral-3-3B-shaped model, {L} blocks (random weights)",
            "general.file_type": 1, **_tokenizer_meta(V)}
    return write_gguf(path, "mistral3", hparams, tensors, meta)  # type: ignore[arg-type]


GPT_OSS_BLOCKS = 2  # of 24, one sliding and one full: real widths and experts, a 5.5 GB F16 file to write


def write_gpt_oss_20b(path: Path, seed: int = 0) -> Path:
    from spekula.fixtures.tiny_gguf import write_gguf

    E, L, nh, nkv, hd, X, K, F, V = 2880, GPT_OSS_BLOCKS, 64, 8, 64, 32, 4, 2880, 201088
    d = _Draw(seed)
    tensors: Tensors = {"token_embd.weight": d.mat(V, E), "output.weight": d.mat(V, E), "output_norm.weight": _ones(E)}
    for i in range(L):
        b = f"blk.{i}."
        tensors |= _attention(d, b, E, nh, nkv, hd) | {
            b + "attn_q.bias": d.small(nh * hd), b + "attn_k.bias": d.small(nkv * hd),
            b + "attn_v.bias": d.small(nkv * hd), b + "attn_output.bias": d.small(E),
            b + "attn_sinks.weight": d.small(nh, scale=1.0),
            b + "attn_norm.weight": _ones(E), b + "post_attention_norm.weight": _ones(E),
            # A router with a wide spread of logits, so tokens really go to different experts.
            b + "ffn_gate_inp.weight": d.small(X, E, scale=1.0), b + "ffn_gate_inp.bias": d.small(X),
            b + "ffn_gate_exps.weight": d.mat(X, F, E), b + "ffn_up_exps.weight": d.mat(X, F, E),
            b + "ffn_down_exps.weight": d.mat(X, E, F),
            b + "ffn_gate_exps.bias": d.small(X, F), b + "ffn_up_exps.bias": d.small(X, F),
            b + "ffn_down_exps.bias": d.small(X, E)}
    hparams = {"context_length": 131072, "embedding_length": E, "block_count": L, "feed_forward_length": F,
               "attention.head_count": nh, "attention.head_count_kv": nkv, "attention.key_length": hd,
               "attention.value_length": hd, "rope.freq_base": 150000.0, "rope.scaling.type": "yarn",
               "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096,
               "attention.layer_norm_rms_epsilon": 1e-5, "attention.sliding_window": 128, "expert_count": X,
               "expert_used_count": K, "expert_feed_forward_length": F}
    meta = {"general.name": f"spekula synthetic gpt-oss-20b-shaped MoE, {L} blocks (random weights)",
            "general.file_type": 1, **_tokenizer_meta(V)}
    return write_gguf(path, "gpt-oss", hparams, tensors, meta)  # type: ignore[arg-type]


SHAPES: dict[str, Callable[..., Path]] = {
    "gemma3-270m": write_gemma3_270m,
    "ministral3-3b": write_ministral3_3b,
    "gpt-oss-20b": write_gpt_oss_20b,
}
PENDING = ("gemma4-1b",)  # asked for by name, skipped with the reason
DEFAULT_MIX = {"gpt-oss-20b": "MXFP4_MOE"}


def unavailable(shape: str) -> str | None:
    """Why `shape` cannot be built on this branch, or None."""
    if shape not in SHAPES and shape not in PENDING:
        return f"unknown synthetic shape {shape!r} (one of {', '.join([*SHAPES, *PENDING])})"
    if shape == "gemma4-1b":
        from spekula.backends.gguf.architecture import ARCHITECTURES

        if "gemma4" not in ARCHITECTURES:
            return "gemma4-1b skipped: the gemma4 architecture has not landed on this branch"
        return "gemma4-1b skipped: the gemma4 architecture is here but this bench has no writer for its shape yet"
    return None


def synthetic_arch(shape: str, mix: str, llama_server: str | None, keep_f16: bool = False) -> Path:
    """The cached ``synthetic-<shape>-<mix>.gguf``, built on first use with the llama-quantize next to
    `llama_server` (the F16 file kept for the next mix when `keep_f16`)."""
    why = unavailable(shape)
    if why:
        raise SystemExit(why)
    return quantized(f"synthetic-{shape}", SHAPES[shape], llama_server, mix, keep_f16=keep_f16)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=[*SHAPES, *PENDING])
    p.add_argument("--mix", help="llama-quantize type (default Q4_K_M; MXFP4_MOE for gpt-oss-20b)")
    p.add_argument("--llama-server", metavar="PATH")
    args = p.parse_args()
    binary = llama_server_binary(args.llama_server)
    print(synthetic_arch(args.shape, args.mix or DEFAULT_MIX.get(args.shape, "Q4_K_M"), binary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
