"""Writing side of `spekula convert`: output tensor types and the llama-family hyper-parameter keys.

Keys and names follow llama.cpp's converter so that llama.cpp itself loads what we write; the gguf
package's enums lack the draft architectures, so arch strings and draft keys are written literally.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from spekula.backends.convert.output import atomic_output, check_output_path
from spekula.core.errors import ConfigError, ModelFileError

# outtype -> (tensor type of 2-D weights, general.file_type value as llama.cpp numbers it)
OUTTYPES: dict[str, tuple[gguf.GGMLQuantizationType, int]] = {
    "f32": (gguf.GGMLQuantizationType.F32, 0),
    "f16": (gguf.GGMLQuantizationType.F16, 1),
    "bf16": (gguf.GGMLQuantizationType.BF16, 32),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, 7),
}


_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


class GGUFOut:
    """Collects keys and tensors, then writes the file atomically (a failed run leaves nothing behind)."""

    def __init__(self, path: str | Path, arch: str, outtype: str) -> None:
        if outtype not in OUTTYPES:
            raise ConfigError(f"unknown --outtype {outtype!r}; choose one of {', '.join(OUTTYPES)}")
        self.path = Path(path)
        # Refused now rather than after minutes of converting; atomic_output checks again when writing.
        check_output_path(self.path, "--outfile")
        self.arch = arch
        self.qtype, file_type = OUTTYPES[outtype]
        # No path yet: the writer gets its temporary file in finish(), so nothing exists on disk
        # before the whole conversion has succeeded in memory.
        self.w = gguf.GGUFWriter(None, arch)
        self.w.add_file_type(file_type)
        # written by llama.cpp's converter into every model file: "model" (not an adapter or projector),
        # and the version of the block-quantization formats (2 since the Q4/Q5/Q8 layouts changed)
        self.w.add_string("general.type", "model")
        self.w.add_uint32("general.quantization_version", 2)
        self.tensor_names: list[str] = []

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def tensor(self, name: str, arr: np.ndarray, *, keep_f32: bool = False) -> None:
        """Add a float tensor given in PyTorch order. Vectors (norms, biases) stay F32 as llama.cpp keeps them;
        a block type's matrix whose rows do not split into whole blocks is stored F16, as llama.cpp's
        converter falls back."""
        data = np.ascontiguousarray(arr, dtype=np.float32)
        if not np.all(np.isfinite(data)):
            raise ModelFileError(name, "tensor holds NaN or Inf values")
        qtype = gguf.GGMLQuantizationType.F32 if (keep_f32 or data.ndim <= 1) else self.qtype
        if qtype not in _FLOAT_TYPES and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = gguf.GGMLQuantizationType.F16
        if qtype == gguf.GGMLQuantizationType.F32:
            self.w.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            self.w.add_tensor(name, data.astype(np.float16))
        else:
            self.w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        self.tensor_names.append(name)

    def i64(self, name: str, arr: np.ndarray) -> None:
        self.w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
        self.tensor_names.append(name)

    def finish(self) -> Path:
        with atomic_output(self.path, "--outfile") as tmp:
            try:
                self.w.write_header_to_file(path=tmp)
                self.w.write_kv_data_to_file()
                self.w.write_tensors_to_file()
            finally:
                self.w.close()
        return self.path

    def abort(self) -> None:
        """Release the writer after a failure; never raises, so the failure itself is what the user sees
        (finish() has already removed its temporary file by then)."""
        with contextlib.suppress(OSError):
            self.w.close()


def rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def head_dim(cfg: dict[str, Any]) -> int:
    hd = cfg.get("head_dim")
    return int(hd) if hd else int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def head_dim_known(raw_config: dict[str, Any], merged: dict[str, Any]) -> bool:
    """Whether llama.cpp's converter sees a ``head_dim``: it loads configs through transformers, whose
    Llama/Mistral/Qwen3 config classes always define one (top-level model_type only); otherwise only an
    explicit value counts, including one inside a nested ``transformer_layer_config``."""
    return raw_config.get("model_type") in ("llama", "mistral", "qwen3") or bool(merged.get("head_dim"))


def write_decoder_keys(out: GGUFOut, cfg: dict[str, Any], *, n_layer: int, where: Path, llama_style: bool,
                       head_dim_keys: bool) -> None:
    """The generic decoder keys llama.cpp's TextModel writes (plus llama's vocab_size/rope dims).

    ``llama_style`` adds ``vocab_size`` and ``rope.dimension_count`` as the llama converter (and so the
    EAGLE-3 one) does.
    """
    for field in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if cfg.get(field) is None:
            raise ModelFileError(where / "config.json", f"missing field {field!r}")
    # Newer configs put the scaling into rope_parameters; either way only default/linear are supported.
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = str(scaling.get("rope_type", scaling.get("type", "default")) or "default").lower()
    if kind not in ("default", "linear"):
        raise ModelFileError(where / "config.json", f"rope_scaling type {kind!r} is not supported by this converter")
    w = out.w
    w.add_uint32(out.key("block_count"), n_layer)
    w.add_uint32(out.key("context_length"), int(cfg.get("max_position_embeddings", 2048)))
    w.add_uint32(out.key("embedding_length"), int(cfg["hidden_size"]))
    w.add_uint32(out.key("feed_forward_length"), int(cfg["intermediate_size"]))
    w.add_uint32(out.key("attention.head_count"), int(cfg["num_attention_heads"]))
    w.add_uint32(out.key("attention.head_count_kv"), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]))
    w.add_float32(out.key("rope.freq_base"), rope_theta(cfg))
    w.add_float32(out.key("attention.layer_norm_rms_epsilon"), float(cfg.get("rms_norm_eps", 1e-6)))
    if head_dim_keys:
        w.add_uint32(out.key("attention.key_length"), head_dim(cfg))
        w.add_uint32(out.key("attention.value_length"), head_dim(cfg))
    if kind == "linear":
        w.add_string(out.key("rope.scaling.type"), "linear")
        w.add_float32(out.key("rope.scaling.factor"), float(scaling["factor"]))
    if llama_style:
        if cfg.get("vocab_size") is not None:
            w.add_uint32(out.key("vocab_size"), int(cfg["vocab_size"]))
        w.add_uint32(out.key("rope.dimension_count"), head_dim(cfg))


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate_half rows -> llama.cpp interleaved-rope rows (per head: 0, hd/2, 1, hd/2+1, ...)."""
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ModelFileError("q/k projection", f"{rows} rows cannot be split into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
