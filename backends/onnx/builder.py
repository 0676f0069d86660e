"""Graph-building primitives shared by the ONNX graph modules: node/initializer bookkeeping and the
float32 linear layer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper

MS_DOMAIN = "com.microsoft"
MS_OPSET = 1  # com.microsoft contrib ops (MatMulNBits, MoE)

# A linear layer emitter: (builder, x, gguf tensor name) -> output name. The fp32 one is MatMul with a
# transposed initializer; the quantized one (onnx/quant.py) emits MatMulNBits from the GGUF blocks.
LinearFn = Callable[["GraphBuilder", str, str], str]


class GraphBuilder:
    """Appends nodes and initializers with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        # Arrays are kept as numpy until the model is written: serializing hundreds of MB through
        # protobuf is slow, so big ones go straight into the external-data file (see to_model).
        self.initializers: dict[str, np.ndarray] = {}
        self._count = 0
        self._consts: dict[tuple[str, bytes], str] = {}

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def init(self, name: str, arr: np.ndarray) -> str:
        if name in self.initializers:
            raise ValueError(f"initializer {name!r} defined twice")
        self.initializers[name] = np.ascontiguousarray(arr)
        return name

    def const(self, values: Sequence[float] | Sequence[int] | np.ndarray, dtype: type = np.int64) -> str:
        """A small shared constant (shapes, axes, scalars)."""
        arr = np.asarray(values, dtype=dtype)
        key = (str(arr.dtype) + str(arr.shape), arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(self._name("c"), arr)
        return self._consts[key]

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, domain: str = "", **attrs: object) -> str:
        outs = [self._name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else ",".join(outs)

    def ops(self, op_type: str, inputs: Sequence[str], n_out: int, **attrs: object) -> list[str]:
        return self.op(op_type, inputs, n_out, **attrs).split(",")

    def rename_output(self, produced: str, name: str) -> None:
        """Give the node output `produced` the graph-output name `name` (via Identity)."""
        self.nodes.append(helper.make_node("Identity", [produced], [name]))


def linear_f32(weights: dict[str, np.ndarray]) -> LinearFn:
    def emit(g: GraphBuilder, x: str, name: str) -> str:
        w = g.init(name, np.ascontiguousarray(weights[name].T))  # [in, out] for MatMul
        return g.op("MatMul", [x, w])

    return emit
