"""ctypes descriptions of a GGUF file's tensors for the native kernels, pointing into the mapped file.

Shared by the native backend, its MoE blocks (native/moe.py) and the native draft-head runtimes.
"""

from __future__ import annotations

import ctypes

import numpy as np

from spekula.backends.gguf.architecture import ModelHParams
from spekula.backends.gguf.weights import dequantize, expected_shapes, optional_shapes
from spekula.backends.native import lib as nl
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile, TensorEntry


class NativeWeights:
    """ctypes descriptions of the model's tensors; keeps every array they point into alive."""

    def __init__(self, f: GGUFFile, hp: ModelHParams | None) -> None:
        """``hp``: the decoder's hyper-parameters, whose tensors' shapes are checked by name; None for a
        file of another kind (a draft head), whose callers give each shape."""
        self.f, self.hp = f, hp
        self.keep: list[np.ndarray] = []
        self.structs: list[ctypes.Structure | ctypes.Array[nl.Tensor]] = []  # MoE descriptions the C side reads
        self.shapes = expected_shapes(hp) | optional_shapes(hp) if hp is not None else {}

    def entry(self, name: str, shape: tuple[int, ...] | None = None) -> TensorEntry:
        if not self.f.has_tensor(name):
            raise ModelFileError(self.f.path, f"missing tensor {name!r} (architecture {self.f.architecture})")
        e = self.f.tensor(name)
        want = shape or self.shapes.get(name)
        if want is not None and e.shape != want:
            raise ModelFileError(self.f.path, f"tensor {name!r} has shape {e.shape}, expected {want}")
        return e

    def vector(self, name: str, required: bool = True) -> np.ndarray | None:
        """A small float32 vector (norm weight, bias) as its own array."""
        if not required and not self.f.has_tensor(name):
            return None
        arr = np.ascontiguousarray(dequantize(self.entry(name), self.f.path), dtype=np.float32).reshape(-1)
        self.keep.append(arr)
        return arr

    def typed_entry(self, name: str, shape: tuple[int, ...] | None = None) -> TensorEntry:
        """A matmul weight's entry, checked to be of a block type the kernels read."""
        e = self.entry(name, shape)
        if e.type_name not in nl.TYPE_IDS:
            raise ModelFileError(
                self.f.path, f"tensor {name!r} has type {e.type_name}, which the native backend does not read "
                f"(it reads {', '.join(nl.TYPE_IDS)}); use --backend torch")
        return e

    def keep_data(self, e: TensorEntry) -> np.ndarray:
        data = np.ascontiguousarray(e.data)  # a view into the mapped file (already contiguous)
        self.keep.append(data)
        return data

    def matrix(self, name: str, bias: str | None = None, shape: tuple[int, ...] | None = None, *,
               bias_required: bool = False) -> nl.Tensor:
        """A matmul weight with its bias (when the file has it, or always with ``bias_required``)."""
        e = self.typed_entry(name, shape)
        data = self.keep_data(e)
        b = self.vector(bias, required=bias_required) if bias else None
        return nl.tensor(data, e.type_name, e.shape[0], e.shape[1], b)
