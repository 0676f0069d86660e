"""The tensors a decoder described by gguf/architecture.py needs, and their float32 values (numpy only).

Shared by the torch and ONNX backends (the native one reads the blocks in place but checks the same
shapes). Tensors come back in PyTorch order under their GGUF names; Q/K rows stay as stored, so a
runtime applies the rope pairing the description names (``ModelHParams.rope_neox``). Every problem
with the file becomes one :class:`ModelFileError`.
"""

from __future__ import annotations

import numpy as np

from spekula.backends.gguf.architecture import DeltaNetParams, ModelHParams
from spekula.backends.gguf.moe import moe_ffn_shapes
from spekula.backends.gguf.rope_scaling import rope_frequencies
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile, TensorEntry

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K", "Q2_K")


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def dequantize(entry: TensorEntry, path: object = "<gguf>") -> np.ndarray:
    """A tensor as a float32 array of shape ``entry.shape`` (PyTorch order)."""
    if entry.type_name not in SUPPORTED_TYPES:
        raise ModelFileError(path, f"tensor {entry.name!r} has unsupported type {entry.type_name} "
                                    f"(supported: {', '.join(SUPPORTED_TYPES)})")
    n = int(np.prod(entry.shape, dtype=np.int64))
    try:
        raw = entry.data
        if entry.type_name == "F32":
            out = np.array(np.asarray(raw).view(np.float32))  # a copy: the mmap'd file is read-only
        elif entry.type_name == "F16":
            out = np.asarray(raw).view(np.float16).astype(np.float32)
        elif entry.type_name == "BF16":
            out = _bf16_to_f32(np.asarray(raw))
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize as gguf_dequantize

            out = gguf_dequantize(np.asarray(raw).view(np.uint8), GGMLQuantizationType[entry.type_name])
        if out.size != n:
            raise ValueError(f"{out.size} values decoded, shape {entry.shape} needs {n}")
        return np.ascontiguousarray(out, dtype=np.float32).reshape(entry.shape)
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(path, f"cannot decode tensor {entry.name!r} ({entry.type_name}): {exc}") from None


def delta_net_shapes(dn: DeltaNetParams, prefix: str, n_embd: int) -> dict[str, tuple[int, ...]]:
    """Required tensors of one gated delta-net block's token mixer (in place of attention)."""
    H, C, V, Hv = n_embd, dn.conv_dim, dn.value_dim, dn.n_v_heads
    return {
        prefix + "attn_qkv.weight": (C, H),  # conv channels [q | k | v]
        prefix + "attn_gate.weight": (V, H),  # z, the output gate
        prefix + "ssm_beta.weight": (Hv, H),
        prefix + "ssm_alpha.weight": (Hv, H),
        prefix + "ssm_dt.bias": (Hv,),
        prefix + "ssm_a": (Hv,),  # -exp(A_log)
        prefix + "ssm_conv1d.weight": (C, dn.conv_kernel),
        prefix + "ssm_norm.weight": (dn.head_v_dim,),
        prefix + "ssm_out.weight": (H, V),
    }


def block_shapes(hp: ModelHParams, i: int) -> dict[str, tuple[int, ...]]:
    """Required tensors of decoder block ``i`` (trunk or MTP block): attention (or the gated delta-net of
    a hybrid's recurrent block), norms, FFN or MoE."""
    H, hd = hp.n_embd, hp.block_head_dim(i) if i < hp.n_layer else hp.head_dim
    q, kv = hp.n_head * hd, (hp.block_n_head_kv(i) if i < hp.n_layer else hp.n_head_kv) * hd
    b = f"blk.{i}."
    shapes: dict[str, tuple[int, ...]] = {b + "attn_norm.weight": (H,), b + hp.ffn_norm_name + ".weight": (H,)}
    if hp.delta_net is not None and hp.is_recurrent(i):
        shapes |= delta_net_shapes(hp.delta_net, b, H)
    else:
        q_rows = 2 * q if hp.recipe.attn_output_gate else q  # [q | gate] per head
        shapes |= {b + "attn_q.weight": (q_rows, H), b + "attn_output.weight": (H, q)}
        owns_kv = hp.layout.owns_kv(i)  # a block reading another's KV has no k/v projections (Gemma 4)
        if owns_kv:
            shapes[b + "attn_k.weight"] = (kv, H)
            if i not in hp.layout.values_from_keys:  # else the values are the key projection's output
                shapes[b + "attn_v.weight"] = (kv, H)
        if hp.has_qk_norm:
            shapes |= {b + "attn_q_norm.weight": (hd,)} | ({b + "attn_k_norm.weight": (hd,)} if owns_kv else {})
        if hp.has_qkv_bias:
            shapes |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
        if hp.recipe.attn_sinks:
            shapes[b + "attn_sinks.weight"] = (hp.n_head,)
    if hp.post_norms:  # the attention (or delta-net) and FFN outputs are RMS-normed before the residual add
        shapes |= {b + "post_attention_norm.weight": (H,), b + "post_ffw_norm.weight": (H,)}
    moe_block = hp.moe is not None and hp.moe.is_moe(i)
    if moe_block:
        shapes |= moe_ffn_shapes(hp.moe, b, H)
    if not moe_block or hp.moe.beside_dense:  # the dense FFN (Gemma 4's MoE blocks have it too)
        ff = hp.block_n_ff(i)
        shapes |= {b + "ffn_gate.weight": (ff, H), b + "ffn_up.weight": (ff, H), b + "ffn_down.weight": (H, ff)}
    P = hp.layout.n_embd_per_layer
    if P and i < hp.n_layer:  # the per-layer input's gate, projection and norm (gguf/block_layout.py)
        shapes |= {b + "inp_gate.weight": (P, H), b + "proj.weight": (H, P), b + "post_norm.weight": (H,)}
    if hp.layout.out_scale and i < hp.n_layer:
        shapes |= {b + "layer_output_scale.weight": (1,)}
    return shapes


def expected_shapes(hp: ModelHParams) -> dict[str, tuple[int, ...]]:
    """Required tensors of the trunk with their shapes; qkv may be fused, handled by the caller."""
    H = hp.n_embd
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (hp.n_vocab, H), "output_norm.weight": (H,)}
    for i in range(hp.n_layer):
        shapes |= block_shapes(hp, i)
    P = hp.layout.n_embd_per_layer
    if P:
        shapes |= {"per_layer_token_embd.weight": (hp.n_vocab, hp.n_layer * P),
                   "per_layer_model_proj.weight": (hp.n_layer * P, H), "per_layer_proj_norm.weight": (P,)}
    return shapes


def optional_shapes(hp: ModelHParams) -> dict[str, tuple[int, ...]]:
    H = hp.n_embd
    shapes: dict[str, tuple[int, ...]] = {
        "output.weight": (hp.n_vocab, H),
        "output.bias": (hp.n_vocab,),
        "rope_freqs.weight": (hp.n_rot // 2,),
    }
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        if hp.moe is not None and hp.moe.beside_dense:  # Gemma 4: each expert's output scale
            shapes[b + "ffn_down_exps.scale"] = (hp.moe.n_expert,)
        shapes |= {
            b + "attn_output.bias": (H,),
            b + "ffn_gate.bias": (hp.n_ff,),
            b + "ffn_up.bias": (hp.n_ff,),
            b + "ffn_down.bias": (H,),
        }
    return shapes


def _split_fused_qkv(f: GGUFFile, hp: ModelHParams, out: dict[str, np.ndarray]) -> None:
    """Files converted with --fuse-qkv hold [q; k; v] rows in one tensor; split it back."""
    q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    for i in range(hp.n_layer):
        if hp.is_recurrent(i):  # a delta-net block's attn_qkv is its conv input, not attention's q, k, v
            continue
        for suffix in ("weight", "bias"):
            name = f"blk.{i}.attn_qkv.{suffix}"
            if not f.has_tensor(name) or f.has_tensor(f"blk.{i}.attn_q.{suffix}"):
                continue
            fused = dequantize(f.tensor(name), f.path)
            if fused.shape[0] != q + 2 * kv:
                raise ModelFileError(f.path, f"tensor {name!r} has {fused.shape[0]} rows, expected {q + 2 * kv}")
            out[f"blk.{i}.attn_q.{suffix}"] = fused[:q]
            out[f"blk.{i}.attn_k.{suffix}"] = fused[q : q + kv]
            out[f"blk.{i}.attn_v.{suffix}"] = fused[q + kv :]


def _split_fused_gate_up_exps(f: GGUFFile, hp: ModelHParams, out: dict[str, np.ndarray]) -> None:
    """Experts stored as one [E, 2F, H] gate/up tensor (Gemma 4's converter): split back into gate and up."""
    if hp.moe is None:
        return
    F = hp.moe.n_ff_exp
    for i in range(hp.n_layer):
        name = f"blk.{i}.ffn_gate_up_exps.weight"
        if not f.has_tensor(name) or f.has_tensor(f"blk.{i}.ffn_gate_exps.weight"):
            continue
        fused = dequantize(f.tensor(name), f.path)
        if fused.ndim != 3 or fused.shape[1] != 2 * F:
            raise ModelFileError(f.path, f"tensor {name!r} has shape {fused.shape}, expected (E, {2 * F}, H)")
        out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = fused[:, :F], fused[:, F:]


def load_model_weights(f: GGUFFile, *, hp: ModelHParams) -> dict[str, np.ndarray]:
    """GGUF tensor names -> float32 arrays (PyTorch order). ``output.weight`` is absent when tied."""
    out: dict[str, np.ndarray] = {}
    _split_fused_qkv(f, hp, out)
    _split_fused_gate_up_exps(f, hp, out)
    for name, shape in expected_shapes(hp).items():
        if name not in out:
            if not f.has_tensor(name):
                raise ModelFileError(f.path, f"missing tensor {name!r} (architecture {hp.arch})")
            out[name] = dequantize(f.tensor(name), f.path)
        if len(shape) == 1 and out[name].shape == (1, *shape):
            out[name] = out[name].reshape(shape)  # a vector stored as one row (Qwen3.5's ffn_gate_inp_shexp)
        if out[name].shape != shape:
            raise ModelFileError(f.path, f"tensor {name!r} has shape {out[name].shape}, expected {shape}")
    for name, shape in optional_shapes(hp).items():
        if f.has_tensor(name):
            arr = dequantize(f.tensor(name), f.path)
            if arr.shape != shape:
                raise ModelFileError(f.path, f"tensor {name!r} has shape {arr.shape}, expected {shape}")
            out[name] = arr
    return out


def rope_inv_freq(hp: ModelHParams, weights: dict[str, np.ndarray], *, sliding: bool = False) -> np.ndarray:
    """Per-pair angular frequency (float64, [n_rot/2]): theta_i(p) = p * inv_freq[i].

    Folds in the optional llama3-style ``rope_freqs`` divisor and the file's linear or YaRN scaling, as
    llama.cpp does (gguf/rope_scaling.py); YaRN's magnitude is ``hp.rope_mscale``, applied to cos and sin.
    ``sliding``: the table of the sliding-window blocks (their own base and scaling).
    """
    base, scaling = (hp.rope_base_swa, hp.scaling_swa) if sliding else (hp.rope_base, hp.scaling)
    if sliding and hp.recipe.block_layout:  # Gemma 4: rope_freqs belong to the global blocks only
        return rope_frequencies(hp.n_rot_swa, base, scaling, None)
    return rope_frequencies(hp.n_rot, base, scaling, weights.get("rope_freqs.weight"))
