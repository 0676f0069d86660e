"""The ONNX export cache: reused when intact, rebuilt when stale or corrupt, GGUF hashed once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from spekula.backends.gguf.architecture import ModelHParams
from spekula.core.backend import BackendOptions, SeqInput
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures.tiny_gguf import tiny_model_path

pytest.importorskip("onnxruntime")
from spekula.backends.onnx import cache as onnx_cache
from spekula.backends.onnx import export as onnx_export
from spekula.backends.onnx.backend import OnnxBackend


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "onnx"


@pytest.fixture
def export_count(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every real export, recorded."""
    calls: list[Path] = []
    real = onnx_export._export

    def counting(f: GGUFFile, hp: ModelHParams, fmt: str, path: Path, meta: dict[str, object]) -> None:
        calls.append(path)
        real(f, hp, fmt, path, meta)

    monkeypatch.setattr(onnx_export, "_export", counting)
    return calls


def _logits(path: Path) -> np.ndarray:
    be = OnnxBackend(path, BackendOptions(n_ctx=64, threads=1))
    seq = be.new_seq()
    ids = np.arange(1, 12, dtype=np.int32)
    return be.forward([SeqInput(seq, ids, 0, np.arange(len(ids)))])[0].logits


def test_second_start_reuses_the_export(cache: Path, export_count: list[Path]) -> None:
    model = tiny_model_path("llama")
    first = _logits(model)
    exp = onnx_export.ensure_export(model)
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    second = _logits(model)
    assert len(export_count) == 1
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    assert np.array_equal(first, second)
    digest = onnx_cache.sha256_file(model)
    assert exp.path.name.startswith(f"{digest}-v{onnx_export.EXPORTER_VERSION}-f32")
    manifest = json.loads(onnx_cache.manifest_path(exp.path).read_text())
    assert set(manifest["files"]) == {exp.path.name, exp.path.name + ".data"}


def test_gguf_is_hashed_once_per_size_and_mtime(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_model_path("qwen2").read_bytes())
    hashed: list[Path] = []
    real = onnx_cache.sha256_file
    monkeypatch.setattr(onnx_cache, "sha256_file", lambda p: hashed.append(Path(p)) or real(p))
    d1 = onnx_cache.gguf_sha256(model)
    d2 = onnx_cache.gguf_sha256(model)
    assert d1 == d2 and hashed == [model.resolve()]
    # New content (and mtime): hashed again, and a different export name follows.
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    os.utime(model, ns=(1, 1))
    assert onnx_cache.gguf_sha256(model) != d1
    assert len(hashed) == 2


def test_exports_of_a_replaced_gguf_are_removed(cache: Path, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_model_path("llama").read_bytes())
    old = onnx_export.ensure_export(model).path
    model.write_bytes(tiny_model_path("qwen2").read_bytes())  # same path, new content
    new = onnx_export.ensure_export(model).path
    assert new != old and new.is_file()
    assert not old.exists() and not old.with_name(old.name + ".data").exists()


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["data-bytes", "graph-truncated", "manifest-missing", "data-missing"])
def test_damaged_export_is_rebuilt(cache: Path, export_count: list[Path], damage: str) -> None:
    model = tiny_model_path("qwen3")
    good = _logits(model)
    exp = onnx_export.ensure_export(model)
    data = exp.path.with_name(exp.path.name + ".data")
    if damage == "data-bytes":  # same size, new mtime: caught by the checksum
        _flip_byte(data, data.stat().st_size // 2)
    elif damage == "graph-truncated":
        exp.path.write_bytes(exp.path.read_bytes()[:100])
    elif damage == "manifest-missing":  # e.g. a crash between writing the files and the manifest
        onnx_cache.manifest_path(exp.path).unlink()
    else:
        data.unlink()
    assert onnx_cache.verify_export(exp.path, {}) is not None
    assert np.array_equal(_logits(model), good)
    assert len(export_count) == 2
    assert onnx_cache.verify_export(exp.path, {"format": "f32"}) is None


def test_touched_but_intact_export_is_kept(cache: Path, export_count: list[Path]) -> None:
    model = tiny_model_path("llama")
    _logits(model)
    exp = onnx_export.ensure_export(model)
    os.utime(exp.path, ns=(10**18, 10**18))
    assert onnx_cache.verify_export(exp.path, {}) is None  # checksum matched; new mtime remembered
    manifest = json.loads(onnx_cache.manifest_path(exp.path).read_text())
    assert manifest["files"][exp.path.name]["mtime_ns"] == 10**18
    _logits(model)
    assert len(export_count) == 1


def test_export_that_ort_rejects_is_rebuilt(cache: Path, export_count: list[Path]) -> None:
    """Damage the manifest cannot see (it was rewritten to match): session creation fails -> rebuild."""
    model = tiny_model_path("llama")
    good = _logits(model)
    exp = onnx_export.ensure_export(model)
    exp.path.write_bytes(b"\x08\x07garbage that is no protobuf model")
    data = exp.path.with_name(exp.path.name + ".data")
    meta = {"exporter": onnx_export.EXPORTER_VERSION, "gguf_sha256": exp.gguf_sha256, "format": "f32"}
    onnx_cache.write_manifest(exp.path, [exp.path, data], meta)
    assert onnx_cache.verify_export(exp.path, meta) is None
    assert np.array_equal(_logits(model), good)
    assert len(export_count) == 2


def test_other_exporter_version_is_not_used(cache: Path, export_count: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model_path("llama")
    _logits(model)
    monkeypatch.setattr(onnx_export, "EXPORTER_VERSION", onnx_export.EXPORTER_VERSION + 1)
    exp = onnx_export.ensure_export(model)
    assert f"-v{onnx_export.EXPORTER_VERSION}-" in exp.path.name
    assert len(export_count) == 2
