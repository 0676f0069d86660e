"""Hyper-parameters and float32 weights of llama / qwen2 / qwen3 / qwen3moe / glm4moe GGUF models (numpy only).

Shared by the torch and ONNX backends. Tensors come back in PyTorch order under their GGUF names.
llama's Q/K rows stay as stored (the converter permuted them for interleaved rope), so a runtime
uses NORM (interleaved) rope for llama and NEOX (rotate-half) for qwen2/qwen3: see
``ModelHParams.rope_neox``. Every problem with the file becomes one :class:`ModelFileError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from spekula.backends.gguf.moe import MOE_ARCHS, MoEParams, moe_ffn_shapes, read_moe_params
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile, TensorEntry

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "glm4moe")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# Rope pairing is fixed per architecture in llama.cpp (llama_model_rope_type), not stored in the file.
_NEOX_ARCHS = frozenset({"qwen2", "qwen3", "qwen3moe", "glm4moe"})
# Per-head q/k RMS norm: always in qwen3 / qwen3moe; in glm4moe when the file has the tensors.
_QK_NORM_ARCHS = frozenset({"qwen3", "qwen3moe"})


@dataclass(frozen=True)
class ModelHParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_base: float
    rope_neox: bool
    n_rot: int
    rms_eps: float
    n_ctx_train: int
    rope_scale: float  # 1 / rope.scaling.factor (linear); 1.0 if absent
    has_qkv_bias: bool
    has_qk_norm: bool
    tied_output: bool
    kq_scale: float = 0.0  # attention score scale; 0.0 means 1/sqrt(head_dim)
    moe: MoEParams | None = None  # None: every block has the dense FFN
    n_nextn: int = 0  # MTP blocks stored after the trunk (blk.{n_layer} ..)
    ffn_norm_name: str = "ffn_norm"  # the norm before the FFN: glm4moe calls it post_attention_norm

    @property
    def attn_scale(self) -> float:
        return self.kq_scale if self.kq_scale > 0.0 else 1.0 / math.sqrt(self.head_dim)


def _uniform(f: GGUFFile, key: str, value: Any) -> int:
    """Per-layer arrays are allowed by the format; we support them only when all entries agree."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ModelFileError(f.path, f"per-layer varying {key!r} is not supported")
        value = value[0]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ModelFileError(f.path, f"metadata {key!r} is not an integer: {value!r}") from None


def read_hparams(f: GGUFFile) -> ModelHParams:
    arch = f.architecture
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(f.path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

    def req(key: str) -> Any:
        return f.require(f"{arch}.{key}")

    def opt(key: str, default: Any) -> Any:
        return f.get(f"{arch}.{key}", default)

    n_embd = _uniform(f, "embedding_length", req("embedding_length"))
    n_head = _uniform(f, "attention.head_count", req("attention.head_count"))
    n_head_kv = _uniform(f, "attention.head_count_kv", opt("attention.head_count_kv", n_head))
    n_nextn = _uniform(f, "nextn_predict_layers", opt("nextn_predict_layers", 0))
    n_layer = _uniform(f, "block_count", req("block_count")) - n_nextn
    # An all-MoE model needs no dense FFN width (qwen3moe files may still carry one).
    n_ff = _uniform(f, "feed_forward_length",
                    opt("feed_forward_length", 0) if arch in MOE_ARCHS else req("feed_forward_length"))
    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv != 0 or n_layer <= 0:
        raise ModelFileError(f.path, f"invalid head counts n_head={n_head} n_head_kv={n_head_kv} or n_layer={n_layer}")
    head_dim = _uniform(f, "attention.key_length", opt("attention.key_length", n_embd // n_head))
    v_dim = _uniform(f, "attention.value_length", opt("attention.value_length", head_dim))
    if v_dim != head_dim:
        raise ModelFileError(f.path, f"key_length {head_dim} != value_length {v_dim} is not supported")
    n_rot = _uniform(f, "rope.dimension_count", opt("rope.dimension_count", head_dim))
    if n_rot <= 0 or n_rot > head_dim or n_rot % 2:
        raise ModelFileError(f.path, f"invalid rope.dimension_count {n_rot} for head_dim {head_dim}")

    rope_scale = 1.0
    scaling = opt("rope.scaling.type", None)
    factor = float(opt("rope.scaling.factor", 0.0) or 0.0)
    if scaling not in (None, "none", "linear"):
        raise ModelFileError(f.path, f"unsupported rope scaling {scaling!r} (only linear)")
    if scaling == "linear" and factor > 0.0:
        rope_scale = 1.0 / factor
    elif scaling is None and float(opt("rope.scale_linear", 0.0) or 0.0) > 0.0:  # older key
        rope_scale = 1.0 / float(opt("rope.scale_linear", 1.0))

    if not f.has_tensor("token_embd.weight"):
        raise ModelFileError(f.path, "missing tensor 'token_embd.weight'")
    n_vocab = f.tensor("token_embd.weight").shape[0]
    # An MTP-only file (llama.cpp's --mtp output) has no trunk blocks: probe the first block it has.
    probe = 0 if f.has_tensor("blk.0.attn_norm.weight") else n_layer
    has_bias = f.has_tensor(f"blk.{probe}.attn_q.bias") or f.has_tensor(f"blk.{probe}.attn_qkv.bias")
    qk_norm = arch in _QK_NORM_ARCHS or f.has_tensor(f"blk.{probe}.attn_q_norm.weight")
    moe = read_moe_params(f, arch, lambda k, v: _uniform(f, k, v)) if arch in MOE_ARCHS else None
    return ModelHParams(
        arch=arch,
        n_vocab=int(n_vocab),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        rope_base=float(opt("rope.freq_base", 10000.0)),
        rope_neox=arch in _NEOX_ARCHS,
        n_rot=n_rot,
        rms_eps=float(req("attention.layer_norm_rms_epsilon")),
        n_ctx_train=_uniform(f, "context_length", opt("context_length", 4096)),
        rope_scale=rope_scale,
        has_qkv_bias=has_bias,
        has_qk_norm=qk_norm,
        tied_output=not f.has_tensor("output.weight"),
        kq_scale=float(opt("attention.scale", 0.0) or 0.0),
        moe=moe,
        n_nextn=n_nextn,
        ffn_norm_name="post_attention_norm" if arch == "glm4moe" else "ffn_norm",
    )


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def dequantize(entry: TensorEntry, path: object = "<gguf>") -> np.ndarray:
    """A tensor as a float32 array of shape ``entry.shape`` (PyTorch order)."""
    if entry.type_name not in SUPPORTED_TYPES:
        raise ModelFileError(path, f"tensor {entry.name!r} has unsupported type {entry.type_name}")
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


def block_shapes(hp: ModelHParams, i: int) -> dict[str, tuple[int, ...]]:
    """Required tensors of decoder block ``i`` (trunk or MTP block): attention, norms, FFN or MoE."""
    H, hd = hp.n_embd, hp.head_dim
    q, kv = hp.n_head * hd, hp.n_head_kv * hd
    b = f"blk.{i}."
    shapes: dict[str, tuple[int, ...]] = {
        b + "attn_norm.weight": (H,),
        b + "attn_q.weight": (q, H),
        b + "attn_k.weight": (kv, H),
        b + "attn_v.weight": (kv, H),
        b + "attn_output.weight": (H, q),
        b + hp.ffn_norm_name + ".weight": (H,),
    }
    if hp.moe is not None and hp.moe.is_moe(i):
        shapes |= moe_ffn_shapes(hp.moe, b, H)
    else:
        shapes |= {b + "ffn_gate.weight": (hp.n_ff, H), b + "ffn_up.weight": (hp.n_ff, H),
                   b + "ffn_down.weight": (H, hp.n_ff)}
    if hp.has_qk_norm:
        shapes |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
    if hp.has_qkv_bias:
        shapes |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
    return shapes


def expected_shapes(hp: ModelHParams) -> dict[str, tuple[int, ...]]:
    """Required tensors of the trunk with their shapes; qkv may be fused, handled by the caller."""
    H = hp.n_embd
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (hp.n_vocab, H), "output_norm.weight": (H,)}
    for i in range(hp.n_layer):
        shapes |= block_shapes(hp, i)
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


def load_model_weights(f: GGUFFile, *, hp: ModelHParams) -> dict[str, np.ndarray]:
    """GGUF tensor names -> float32 arrays (PyTorch order). ``output.weight`` is absent when tied."""
    out: dict[str, np.ndarray] = {}
    _split_fused_qkv(f, hp, out)
    for name, shape in expected_shapes(hp).items():
        if name not in out:
            if not f.has_tensor(name):
                raise ModelFileError(f.path, f"missing tensor {name!r} (architecture {hp.arch})")
            out[name] = dequantize(f.tensor(name), f.path)
        if out[name].shape != shape:
            raise ModelFileError(f.path, f"tensor {name!r} has shape {out[name].shape}, expected {shape}")
    for name, shape in optional_shapes(hp).items():
        if f.has_tensor(name):
            arr = dequantize(f.tensor(name), f.path)
            if arr.shape != shape:
                raise ModelFileError(f.path, f"tensor {name!r} has shape {arr.shape}, expected {shape}")
            out[name] = arr
    return out


def rope_inv_freq(hp: ModelHParams, weights: dict[str, np.ndarray]) -> np.ndarray:
    """Per-pair angular frequency (float64, [n_rot/2]): theta_i(p) = p * inv_freq[i].

    Folds in linear scaling and the optional llama3-style ``rope_freqs`` divisor, as llama.cpp does.
    """
    i = np.arange(hp.n_rot // 2, dtype=np.float64)
    inv = hp.rope_scale * hp.rope_base ** (-2.0 * i / hp.n_rot)
    ff = weights.get("rope_freqs.weight")
    if ff is not None:
        inv = inv / ff.astype(np.float64)
    return inv
