"""Read a GGUF file's metadata and tensor directory with one clear error on damage.

This is the only place that opens GGUF files for reading; model loaders (weights) and the tokenizer
(vocabulary, chat template) both take a :class:`GGUFFile`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the file: `shape` in PyTorch order (outermost first), `data` as stored."""

    name: str
    type_name: str  # GGMLQuantizationType name: F32, F16, BF16, Q8_0, Q4_1, ...
    shape: tuple[int, ...]
    data: np.ndarray  # raw bytes view for quantized types, typed array for float types


class GGUFFile:
    """An opened GGUF file. Metadata values are plain Python (str, int, float, bool, list)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(self.path, "no such file")
        with open(self.path, "rb") as fh:
            magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise ModelFileError(self.path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            import gguf

            self._reader = gguf.GGUFReader(str(self.path), "r")
        except ModelFileError:
            raise
        except Exception as exc:  # the gguf package raises ValueError/IndexError/struct errors on damage
            raise ModelFileError(self.path, f"corrupt or truncated GGUF ({type(exc).__name__}: {exc})") from None
        self._check_tensor_extents()

    def _check_tensor_extents(self) -> None:
        size = self.path.stat().st_size
        for t in self._reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelFileError(
                    self.path, f"truncated: tensor {t.name!r} ends at byte {end} but the file has {size}"
                )

    @cached_property
    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                out[key] = field.contents()
            except Exception as exc:
                raise ModelFileError(self.path, f"unreadable metadata key {key!r}: {exc}") from None
        return out

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(self.path, f"missing metadata key {key!r}")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    @cached_property
    def _tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self._reader.tensors}

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> TensorEntry:
        t = self._tensors.get(name)
        if t is None:
            raise ModelFileError(self.path, f"missing tensor {name!r}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return TensorEntry(name=name, type_name=t.tensor_type.name, shape=shape, data=t.data)

    def tensors(self) -> Iterator[TensorEntry]:
        for name in self._tensors:
            yield self.tensor(name)
