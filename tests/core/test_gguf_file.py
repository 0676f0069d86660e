"""GGUFFile: same metadata and tensor views as gguf.GGUFReader, one clear error on damage."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures.tiny_gguf import tiny_model_path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_matches_gguf_reader(arch: str) -> None:
    path = tiny_model_path(arch)
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(str(path))
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == ref_meta
    assert ours.architecture == arch
    assert ours.tensor_names() == [t.name for t in ref.tensors]
    for t in ref.tensors:
        e = ours.tensor(t.name)
        assert e.type_name == t.tensor_type.name
        assert e.shape == tuple(reversed(t.shape.tolist()))
        assert e.data.dtype == t.data.dtype and e.data.shape == t.data.shape
        assert np.array_equal(e.data.view(np.uint8), t.data.view(np.uint8))


def _damaged(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_damaged_files_give_one_clear_error(tmp_path: Path) -> None:
    good = tiny_model_path("llama").read_bytes()
    cases = {
        "missing.gguf": None,
        "text.gguf": b"hello world, not a model at all" * 4,
        "short.gguf": b"GGUF",
        "header_cut.gguf": good[:200],
        "data_cut.gguf": good[: len(good) - 100],
        "bad_version.gguf": good[:4] + (99).to_bytes(4, "little") + good[8:],
    }
    expected = {
        "missing.gguf": "no such file",
        "text.gguf": "not a GGUF file",
        "short.gguf": "not a GGUF file",
        "header_cut.gguf": "truncated",
        "data_cut.gguf": "truncated",
        "bad_version.gguf": "unsupported GGUF version 99",
    }
    for name, data in cases.items():
        path = tmp_path / name if data is None else _damaged(tmp_path, name, data)
        with pytest.raises(ModelFileError) as info:
            GGUFFile(path)
        assert expected[name] in str(info.value), name
        assert str(path) in str(info.value)


def test_missing_tensor_and_key_are_named() -> None:
    f = GGUFFile(tiny_model_path("llama"))
    with pytest.raises(ModelFileError, match="missing tensor 'nope.weight'"):
        f.tensor("nope.weight")
    with pytest.raises(ModelFileError, match="missing metadata key 'nope.key'"):
        f.require("nope.key")


def test_common_tensor_types_agree_with_the_gguf_package() -> None:
    from spekula.core.modelfile.gguf_file import COMMON_TYPES

    for type_id, (name, block, size) in COMMON_TYPES.items():
        t = gguf.GGMLQuantizationType(type_id)
        assert (t.name, gguf.GGML_QUANT_SIZES[t]) == (name, (block, size))


def _resident_kb(path: Path) -> int:
    """This process's resident kB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_a_parsed_header_leaves_no_resident_pages(tmp_path: Path) -> None:
    """The header's pages are read once into the metadata; they do not stay in the resident set (a 262k
    vocabulary's ~5 MB), and the metadata read from them stays whole."""
    path = tmp_path / "big-vocab.gguf"
    tokens = [f"token{i}" for i in range(200_000)]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(tokens)
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)  # a new file: parsed, not from the header cache
    assert _resident_kb(path) < 256, f"{_resident_kb(path)} kB of the file resident after parsing its header"
    assert list(f.metadata["tokenizer.ggml.tokens"]) == tokens
    assert np.array_equal(f.tensor("output_norm.weight").data, np.ones(8, np.float32))
