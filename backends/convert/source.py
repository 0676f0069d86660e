"""Read a Hugging Face checkpoint directory (config.json + *.safetensors) with numpy only.

The safetensors header is parsed here instead of through ``safetensors.numpy`` because numpy has no
bfloat16: most published drafts are stored in bf16, and the converter must read them without torch.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spekula.core.errors import ModelFileError

_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 on read
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


@dataclass(frozen=True, slots=True)
class _TensorRef:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def _read_header(path: Path) -> dict[str, _TensorRef]:
    try:
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise ModelFileError(path, "truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > 100_000_000:
                raise ModelFileError(path, f"implausible safetensors header length {n}")
            header = json.loads(fh.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(path, f"unreadable safetensors header: {exc}") from None
    base = 8 + n
    size = path.stat().st_size
    refs: dict[str, _TensorRef] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(path, f"malformed safetensors entry for {name!r}") from None
        if dtype not in _DTYPES:
            raise ModelFileError(path, f"tensor {name!r} has unsupported dtype {dtype}")
        if base + e > size:
            raise ModelFileError(path, f"truncated: tensor {name!r} ends past the end of the file")
        refs[name] = _TensorRef(path, dtype, shape, base + b, base + e)
    return refs


def load_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config, tokenizer) that must hold one object; ModelFileError otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(path, f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFileError(path, "not a JSON object")
    return data


@dataclass
class HFCheckpoint:
    """A checkpoint directory: parsed config and lazily read tensors (float tensors come back as float32)."""

    path: Path
    config: dict[str, Any]
    _refs: dict[str, _TensorRef] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path) -> HFCheckpoint:
        root = Path(path)
        if not root.is_dir():
            raise ModelFileError(root, "not a directory (expected a Hugging Face checkpoint folder)")
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise ModelFileError(root, "no config.json in the checkpoint folder")
        config = load_json_object(cfg_path)
        files = sorted(root.glob("*.safetensors"))
        refs: dict[str, _TensorRef] = {}
        for f in files:
            refs.update(_read_header(f))
        return cls(root, config, refs)

    def require_tensors(self) -> None:
        if not self._refs:
            raise ModelFileError(self.path, "no tensors found (expected *.safetensors files)")

    def names(self) -> list[str]:
        return list(self._refs)

    def __contains__(self, name: str) -> bool:
        return name in self._refs

    def shape(self, name: str) -> tuple[int, ...]:
        return self._ref(name).shape

    def _ref(self, name: str) -> _TensorRef:
        ref = self._refs.get(name)
        if ref is None:
            raise ModelFileError(self.path, f"missing tensor {name!r}")
        return ref

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (integer and bool tensors keep their integer type)."""
        ref = self._ref(name)
        with open(ref.file, "rb") as fh:
            fh.seek(ref.begin)
            buf = fh.read(ref.end - ref.begin)
        arr = np.frombuffer(buf, dtype=_DTYPES[ref.dtype])
        if arr.size != int(np.prod(ref.shape, dtype=np.int64)):
            raise ModelFileError(ref.file, f"tensor {name!r}: byte size does not match shape {ref.shape}")
        arr = arr.reshape(ref.shape)
        if ref.dtype == "BF16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        if ref.dtype in ("F16", "F64"):
            return arr.astype(np.float32)
        return arr.copy() if ref.dtype == "F32" else arr

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._refs:
            yield name, self.get(name)


def merged_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model's fields in ``text_config``: lift them to the top."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else dict(config)


def need(config: dict[str, Any], key: str, where: Path) -> Any:
    if key not in config or config[key] is None:
        raise ModelFileError(where / "config.json", f"missing field {key!r}")
    return config[key]
