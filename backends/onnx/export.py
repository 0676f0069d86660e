"""Export a GGUF decoder (as gguf/architecture.py describes it) to a cached ONNX graph; reuse the cache when
it is intact.

One export per (GGUF content, exporter version, weight format); the graph outputs every capturable
hidden state, so drafters' capture sets need no further variants (see onnx/cache.py for the cache
layout and integrity checks).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import structlog
from onnx import TensorProto, helper, numpy_helper

from spekula.backends.gguf.architecture import ModelHParams, read_hparams
from spekula.backends.gguf.recipes import FEATURE_ATTN_TEMPERATURE, FEATURE_ROPE_MSCALE
from spekula.backends.gguf.weights import load_model_weights
from spekula.backends.onnx import cache as onnx_cache
from spekula.backends.onnx.builder import LinearFn, linear_f32
from spekula.backends.onnx.graph import BuiltGraph, build_graph
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile

log = structlog.get_logger("spekula.onnx")

# Bump whenever the graph or the weight layout changes: old cache entries then stop matching.
# 3: MoE blocks and their moe_rows input.
EXPORTER_VERSION = 3
WEIGHT_FORMATS = ("f32", "q4")
_PAGE = 4096  # external tensors start on page boundaries so ORT can memory-map them
_INLINE_BYTES = 1024  # smaller initializers stay inside the graph file


@dataclass(frozen=True, slots=True)
class Export:
    """A usable export: the graph file and the model's hyper-parameters."""

    path: Path
    hp: ModelHParams
    weight_format: str
    gguf_sha256: str
    name: str  # general.name, else the file name


def open_model(model_path: str | os.PathLike[str]) -> tuple[GGUFFile, ModelHParams]:
    """Open and validate the GGUF (ModelFileError on damage or an unsupported architecture)."""
    f = GGUFFile(model_path)
    # YaRN's magnitude and the queries' temperature are in the graph (graph.py); the other FEATURES are not.
    return f, read_hparams(f, implements=frozenset({FEATURE_ROPE_MSCALE, FEATURE_ATTN_TEMPERATURE}),
                           runtime="the onnx backend")


def write_model(built: BuiltGraph, onnx_path: Path) -> Path:
    """Write graph + external weights under temporary names, then move both into place."""
    data_path = onnx_path.with_name(onnx_path.name + ".data")
    tag = f".tmp{os.getpid()}"
    tmp_data = data_path.with_name(data_path.name + tag)
    model = onnx.ModelProto()
    model.CopyFrom(built.model)
    offset = 0
    with open(tmp_data, "wb") as fh:
        for name, arr in built.arrays.items():
            if arr.nbytes < _INLINE_BYTES:
                model.graph.initializer.append(numpy_helper.from_array(arr, name))
                continue
            pad = -offset % _PAGE
            fh.write(b"\0" * pad)
            offset += pad
            fh.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
            t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype), dims=arr.shape)
            # `location` is relative to the graph file, so it names the final file, not the temporary one.
            for key, value in (("location", data_path.name), ("offset", offset), ("length", arr.nbytes)):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            t.data_location = TensorProto.EXTERNAL
            model.graph.initializer.append(t)
            offset += arr.nbytes
    tmp_onnx = onnx_path.with_name(onnx_path.name + tag)
    tmp_onnx.write_bytes(model.SerializeToString())
    os.replace(tmp_data, data_path)
    os.replace(tmp_onnx, onnx_path)
    return data_path


def _linear_for(weight_format: str, f: GGUFFile, weights: dict[str, np.ndarray]) -> LinearFn:
    if weight_format == "f32":
        return linear_f32(weights)
    from spekula.backends.onnx.quant import linear_q4

    return linear_q4(f, weights)


def _export(f: GGUFFile, hp: ModelHParams, weight_format: str, onnx_path: Path, meta: dict[str, object]) -> None:
    t0 = time.perf_counter()
    weights = load_model_weights(f, hp=hp)
    built = build_graph(hp, weights, _linear_for(weight_format, f, weights))
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    data_path = write_model(built, onnx_path)
    onnx.checker.check_model(str(onnx_path))  # structural check; also catches a bad external reference
    onnx_cache.write_manifest(onnx_path, [onnx_path, data_path], meta)
    log.info("onnx export written", path=str(onnx_path), seconds=round(time.perf_counter() - t0, 1))


def ensure_export(model_path: str | os.PathLike[str], weight_format: str = "f32") -> Export:
    """The cached export of `model_path`, (re)built when missing, stale or corrupt."""
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"onnx weight format {weight_format!r} unknown; available: {', '.join(WEIGHT_FORMATS)}")
    f, hp = open_model(model_path)
    digest = onnx_cache.model_sha256(f.shard_paths)
    onnx_path = onnx_cache.onnx_dir() / f"{digest}-v{EXPORTER_VERSION}-{weight_format}.onnx"
    meta: dict[str, object] = {"exporter": EXPORTER_VERSION, "gguf_sha256": digest, "format": weight_format}
    why = onnx_cache.verify_export(onnx_path, meta)
    if why is not None:
        if why != "no manifest" or onnx_path.exists():
            log.info("onnx export cache entry unusable; rebuilding", path=str(onnx_path), reason=why)
        onnx_cache.remove_export(onnx_path)
        _export(f, hp, weight_format, onnx_path, meta)
        # Exports of this model and format by other exporter versions are dead weight (hundreds of MB).
        for old in onnx_path.parent.glob(f"{digest}-v*-{weight_format}.onnx"):
            if old != onnx_path:
                onnx_cache.remove_export(old)
    name = str(f.get("general.name", "") or f.path.stem)
    return Export(onnx_path, hp, weight_format, digest, name)

