"""The two routes to a quantized fixture (fixtures/quant_routes.py): llama-quantize and the fixtures' own
block writers, which CI (no llama.cpp binaries) takes. The writers must choose each tensor's type as
llama-quantize does; where the tool is installed both routes' files must hold the same tensors in the
same types, MXFP4 (and gpt-oss's MXFP4_MOE mixture) byte for byte, the other types (whose scales
llama.cpp searches for and the writers do not) within a stated error of the float values.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from backend_conformance import wide_f32_path_or_skip

from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures.llamacpp_quantize import LlamaQuantizeUnavailable
from spekula.fixtures.quant_routes import TYPES, mxfp4_moe_tensor_type, quantized_path, tensor_type
from spekula.fixtures.tiny_gptoss import tiny_gptoss_gguf_path
from spekula.fixtures.wide_archs import ARCHS

SAMPLE = {arch: TYPES[i % len(TYPES)] for i, arch in enumerate(ARCHS)}
# rms(dequantized - float) / rms(float) over the quantized tensors, either route. Measured: IQ4_NL / IQ4_XS
# 0.077 (tool) / 0.080 (writers), MXFP4 0.115 both, Q3_K 0.151 / 0.155, Q2_K 0.297 / 0.329.
REL_RMS = {"IQ4_NL": 0.09, "IQ4_XS": 0.09, "MXFP4": 0.13, "Q3_K": 0.17, "Q2_K": 0.36}
WRITERS_OVER_TOOL = 1.15  # the writers' plain scales: at most this much more error than llama.cpp's search


def matrix_params() -> list[object]:
    return [pytest.param(arch, t, marks=() if SAMPLE[arch] == t else pytest.mark.quant_matrix, id=f"{arch}@{t}")
            for arch in ARCHS for t in TYPES]


def tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    return {e.name: (e.type_name, np.array(e.data)) for e in GGUFFile(path).tensors()}


def dequantized(type_name: str, data: np.ndarray) -> np.ndarray:
    if type_name in ("F32", "F16"):
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])


def tool_path(src: Path, type_name: str) -> Path:
    try:
        return quantized_path(src, type_name, "llama-quantize")
    except LlamaQuantizeUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize(("arch", "type_name"), matrix_params())
def test_writers_choose_each_tensors_type_as_llama_quantize(arch: str, type_name: str) -> None:
    src = tensors(wide_f32_path_or_skip(arch))
    got = tensors(quantized_path(wide_f32_path_or_skip(arch), type_name, "writers"))
    assert got.keys() == src.keys()
    for name, (stored, _) in got.items():
        assert stored == tensor_type(name, src[name][1].shape, type_name), name
    assert any(stored == type_name for stored, _ in got.values())


@pytest.mark.parametrize(("arch", "type_name"), matrix_params())
def test_both_routes_give_the_same_layout_and_close_values(arch: str, type_name: str) -> None:
    src_path = wide_f32_path_or_skip(arch)
    tool = tensors(tool_path(src_path, type_name))
    writers = tensors(quantized_path(src_path, type_name, "writers"))
    src = tensors(src_path)
    assert {k: (t, d.shape) for k, (t, d) in tool.items()} == {k: (t, d.shape) for k, (t, d) in writers.items()}
    if type_name == "MXFP4":  # gguf's MXFP4 quantizer follows llama.cpp's reference one
        assert all(np.array_equal(tool[k][1], writers[k][1]) for k in tool)
    err = {}
    for route, files in (("tool", tool), ("writers", writers)):
        num = den = 0.0
        for name, (stored, data) in files.items():
            if stored == "F32":
                continue
            want = src[name][1]
            num += float(((dequantized(stored, data).reshape(want.shape) - want) ** 2).sum())
            den += float((want ** 2).sum())
        err[route] = (num / den) ** 0.5
    assert max(err.values()) <= REL_RMS[type_name], err
    assert err["writers"] <= WRITERS_OVER_TOOL * err["tool"], err


def test_gptoss_mxfp4_moe_writers_lay_out_llama_quantizes_mixture() -> None:
    src = tensors(tiny_gptoss_gguf_path("f32"))
    writers = tensors(tiny_gptoss_gguf_path("mxfp4", route="writers"))
    assert {k: t for k, (t, _) in writers.items()} == {k: mxfp4_moe_tensor_type(k, d.shape) for k, (_, d) in src.items()}
    assert {t for t, _ in writers.values()} == {"F32", "Q8_0", "MXFP4"}
    try:
        tool = tensors(tiny_gptoss_gguf_path("mxfp4", route="llama-quantize"))
    except LlamaQuantizeUnavailable:
        return  # the layout above is what CI can check
    assert tool.keys() == writers.keys()
    for name, (stored, data) in tool.items():
        assert stored == writers[name][0] and np.array_equal(data, writers[name][1]), name
