"""Keep GGUF Q4_0 / Q4_1 / Q8_0 linear weights as blocks for ORT's MatMulNBits (com.microsoft).

MatMulNBits computes ``A @ W.T`` with ``W[n, k] = (q[n, k] - zp[n, k // bs]) * scale[n, k // bs]``, the
same affine block form GGUF uses, so the weights are re-packed, never re-quantized:

  Q4_0  w = d * (q - 8)            -> bits 4, scale d, zero point 8 (MatMulNBits' default)
  Q4_1  w = d * q + m              -> bits 4, scale d, zero point 0, plus  blocksum(A) @ m.T
  Q8_0  w = d * q, q int8          -> bits 8, stored q + 128, zero point 128 (the default)

Q4_1's offset m could be a float zero point (-m/d), but ORT runs float zero points through a slow
generic kernel (measured ~40x slower than fp32 MatMul for a 576x1536 weight); splitting off the offset
as a tiny [.., K/32] x [K/32, N] matmul keeps the MLAS fast path.

Measured on this CPU (AVX2, one thread, 576x1536): MatMulNBits with fp32 activations is ~3x *slower*
than an fp32 MatMul (it dequantizes on the fly), while ``accuracy_level=4`` (activations quantized to
int8 per block, integer dot products) is ~1.7x faster. So the q4 format uses accuracy_level 4, and its
logits differ from fp32 by more than the 1e-3 exactness bound: it is opt-in (dtype "q4"), f32 stays
the default. End to end on SmolLM2 (bench/backends.py, same machine): a decode step takes ~0.3x torch's
time with q4 against ~0.45x with f32, while logits move by up to ~2.5 and the argmax of ~14% of rows
(random tokens) changes. Exact mode stays bitwise chunking-invariant with q4 (activations are quantized
per row and block), so speculation on a q4 target is lossless with respect to q4 plain decoding. Nibble order differs too: a GGUF 4-bit block keeps element j in the low nibble of byte j
and element j+16 in the high nibble; MatMulNBits packs consecutive elements (2i low, 2i+1 high).
Any other tensor type (F16, K-quants, ...) falls back to the float32 MatMul of onnx_builder.linear_f32.
"""

from __future__ import annotations

import numpy as np

from spekula.backends.onnx.builder import MS_DOMAIN, GraphBuilder, LinearFn, linear_f32
from spekula.core.modelfile.gguf_file import GGUFFile

QK = 32  # block size of Q4_0 / Q4_1 / Q8_0
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QUANTIZED_TYPES = tuple(_BLOCK_BYTES)
ACCURACY_LEVEL = 4  # int8 activations: the only MatMulNBits mode faster than fp32 MatMul here (see above)


def _blocks(raw: np.ndarray, n: int, k: int, type_name: str) -> np.ndarray:
    """The tensor's bytes as [N, K/32, block bytes]."""
    return np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // QK, _BLOCK_BYTES[type_name])


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _repack_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] GGUF nibbles (j | j+16) -> [..., 16] MatMulNBits nibbles (2i | 2i+1)."""
    elems = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., 32] in element order
    return (elems[..., 0::2] | (elems[..., 1::2] << 4)).astype(np.uint8)


def pack_matmul_nbits(raw: np.ndarray, type_name: str, n: int, k: int) -> dict[str, np.ndarray | int]:
    """MatMulNBits inputs for one GGUF tensor of shape [n, k]: bits, B, scales, and for Q4_1 the zero
    points (all 0) and the per-block offsets m as a [K/32, N] matrix."""
    blocks = _blocks(raw, n, k, type_name)
    nb = k // QK
    scale = _f16(blocks, 0)  # [N, nb]
    if type_name == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
        return {"bits": 8, "B": q.astype(np.uint8), "scales": scale.reshape(-1)}
    if type_name == "Q4_0":
        return {"bits": 4, "B": _repack_nibbles(blocks[..., 2:]), "scales": scale.reshape(-1)}
    m = _f16(blocks, 2)
    return {"bits": 4, "B": _repack_nibbles(blocks[..., 4:]), "scales": scale.reshape(-1),
            "zero_points": np.zeros(n * ((nb + 1) // 2), dtype=np.uint8),  # 4-bit zeros, rows padded to bytes
            "offsets": np.ascontiguousarray(m.T)}


def linear_q4(f: GGUFFile, weights: dict[str, np.ndarray], accuracy_level: int = ACCURACY_LEVEL) -> LinearFn:
    """Linear emitter: MatMulNBits for Q4_0/Q4_1/Q8_0 GGUF tensors, float32 MatMul for the rest."""
    fallback = linear_f32(weights)

    def emit(g: GraphBuilder, x: str, name: str) -> str:
        entry = f.tensor(name) if f.has_tensor(name) else None  # fused-QKV splits exist only as floats
        if entry is None or entry.type_name not in QUANTIZED_TYPES or entry.shape[-1] % QK:
            return fallback(g, x, name)
        n, k = entry.shape
        parts = pack_matmul_nbits(entry.data, entry.type_name, n, k)
        inputs = [x, g.init(name + ".qblocks", parts["B"]), g.init(name + ".qscales", parts["scales"])]
        if "zero_points" in parts:
            inputs.append(g.init(name + ".qzeros", parts["zero_points"]))
        y = g.op("MatMulNBits", inputs, domain=MS_DOMAIN, K=k, N=n, bits=parts["bits"], block_size=QK,
                 accuracy_level=accuracy_level)
        if "offsets" in parts:  # Q4_1: + sum over each block of x, times that block's m
            block_sums = g.op("ReduceSum", [g.op("Reshape", [x, g.const([0, 0, k // QK, QK])]), g.const([-1])],
                              keepdims=0)
            y = g.op("Add", [y, g.op("MatMul", [block_sums, g.init(name + ".qoffsets", parts["offsets"])])])
        return y

    return emit
