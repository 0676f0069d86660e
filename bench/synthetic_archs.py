"""Synthetic GGUFs in the shapes of Gemma 3 270M, Gemma 4 E2B, Ministral 3 3B and gpt-oss-20b, for speed and memory
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
* ``gemma4-1b``: the smallest Gemma 4 (E2B)'s widths at 10 of its 35 blocks, about 1 B parameters
  (0.49 B in the blocks, the 0.40 B tied embedding, and 0.67 B of per-layer token embeddings of which a
  token reads one row): hidden 1536, 8 query / 1 key-value heads of 256 in the sliding blocks and 512 in
  the global ones, window 512 on four blocks of five (the E2B's pattern), feed-forward 6144 and twice that
  in the blocks without KV of their own (``use_double_wide_mlp``), which are the last half (the E2B: the
  last 20 of 35; here the last 5 of 10, so the shared sliding and global blocks read blocks 3 and 4),
  per-layer inputs of 256, proportional rope (a quarter of the global heads roped, base 1e6; the sliding
  ones whole, base 10000), final logits soft-capped at 30, vocabulary 262144. The depth is cut, as
  ministral3-3b's, so that the F16 file (3.1 GB, 35 blocks would be 9 GB, most of it the per-layer
  table) is written and quantized in a few minutes on the benchmark machine.

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


GEMMA4_BLOCKS, GEMMA4_SHARED = 10, 5  # of the E2B's 35 and 20: widths real, depth cut for the run's time


def write_gemma4_1b(path: Path, seed: int = 0) -> Path:
    from spekula.fixtures.tiny_gguf import write_gguf

    E, L, nh, nkv, hd_swa, hd, ff, P, V = 1536, GEMMA4_BLOCKS, 8, 1, 256, 512, 6144, 256, 262144
    pattern = [(i + 1) % 5 != 0 for i in range(L)]  # four sliding blocks, then a global one
    first_shared = L - GEMMA4_SHARED
    n_ff = [ff if i < first_shared else 2 * ff for i in range(L)]
    d = _Draw(seed)
    # The converter's proportional rope: the first quarter of the global heads' pairs rotate, the rest
    # get a factor of 1e30 (an angle of zero).
    n_rot_pairs = hd // 2 // 4
    rope_freqs = np.array([1.0] * n_rot_pairs + [1e30] * (hd // 2 - n_rot_pairs), np.float32)
    tensors: Tensors = {"token_embd.weight": d.mat(V, E), "output_norm.weight": _ones(E),
                        "per_layer_token_embd.weight": d.mat(V, L * P), "per_layer_model_proj.weight": d.mat(L * P, E),
                        "per_layer_proj_norm.weight": _ones(P), "rope_freqs.weight": rope_freqs}
    for i in range(L):
        b, h = f"blk.{i}.", hd_swa if pattern[i] else hd
        # Attention scale 1 (Gemma 4 leaves it to the q/k norms): with unit norm weights, random q and k of
        # 512 dims score with a spread of ~22, a softmax so peaked that float rounding decides which key wins
        # (spekula and llama-server then part from the first token). Weights h^-1/4 give scores of unit spread,
        # what trained norms do.
        qk_norm = np.full(h, h**-0.25, np.float32)
        block: Tensors = {b + "attn_q.weight": d.mat(nh * h, E), b + "attn_output.weight": d.mat(E, nh * h),
                          b + "attn_q_norm.weight": qk_norm}
        if i < first_shared:  # a block that owns its keys and values
            block |= {b + "attn_k.weight": d.mat(nkv * h, E), b + "attn_v.weight": d.mat(nkv * h, E),
                      b + "attn_k_norm.weight": qk_norm}
        tensors |= block | _ffn(d, b, E, n_ff[i]) | {
            b + "attn_norm.weight": _ones(E), b + "ffn_norm.weight": _ones(E),
            b + "post_attention_norm.weight": _ones(E), b + "post_ffw_norm.weight": _ones(E),
            b + "inp_gate.weight": d.mat(P, E), b + "proj.weight": d.mat(E, P), b + "post_norm.weight": _ones(E),
            b + "layer_output_scale.weight": np.full(1, 0.5, np.float32)}
    hparams = {"context_length": 131072, "embedding_length": E, "block_count": L, "feed_forward_length": n_ff,
               "attention.head_count": nh, "attention.head_count_kv": nkv, "attention.key_length": hd,
               "attention.value_length": hd, "attention.key_length_swa": hd_swa, "attention.value_length_swa": hd_swa,
               "rope.dimension_count": hd, "rope.dimension_count_swa": hd_swa, "rope.freq_base": 1000000.0,
               "rope.freq_base_swa": 10000.0, "attention.layer_norm_rms_epsilon": 1e-6,
               "attention.sliding_window": 512, "attention.sliding_window_pattern": pattern,
               "attention.shared_kv_layers": GEMMA4_SHARED, "embedding_length_per_layer_input": P,
               "final_logit_softcapping": 30.0}
    meta = {"general.name": f"spekula synthetic Gemma-4-E2B-shaped model, {L} blocks (random weights)",
            "general.file_type": 1, **_tokenizer_meta(V)}
    return write_gguf(path, "gemma4", hparams, tensors, meta)  # type: ignore[arg-type]


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
    "gemma4-1b": write_gemma4_1b,
    "ministral3-3b": write_ministral3_3b,
    "gpt-oss-20b": write_gpt_oss_20b,
}
PENDING: tuple[str, ...] = ()  # asked for by name, skipped with the reason
DEFAULT_MIX = {"gpt-oss-20b": "MXFP4_MOE"}


def unavailable(shape: str) -> str | None:
    """Why `shape` cannot be built on this branch, or None."""
    if shape not in SHAPES and shape not in PENDING:
        return f"unknown synthetic shape {shape!r} (one of {', '.join([*SHAPES, *PENDING])})"
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
