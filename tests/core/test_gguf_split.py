"""Split GGUF sets (llama-gguf-split's shards) open as one model, given any shard; damaged sets are one
clear error naming the file at fault."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.gguf_split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT
from spekula.fixtures.gguf_split_writer import gguf_split_tool, split_with_tool, write_split
from spekula.fixtures.tiny_gguf import build, tiny_model_path

SPLIT_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT)


def _same_model(split: GGUFFile, single: GGUFFile) -> None:
    assert {k: v for k, v in split.metadata.items() if k not in SPLIT_KEYS} == single.metadata
    assert split.tensor_names() == single.tensor_names()
    for name in single.tensor_names():
        a, b = split.tensor(name), single.tensor(name)
        assert (a.type_name, a.shape, a.data.dtype, a.data.shape) == (b.type_name, b.shape, b.data.dtype, b.data.shape)
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8))


@pytest.mark.parametrize("first_without_tensors", [False, True])
def test_split_set_reads_as_the_single_file_from_any_shard(tmp_path: Path, first_without_tensors: bool) -> None:
    src = tiny_model_path("llama")
    single = GGUFFile(src)
    paths = write_split(src, tmp_path / "tiny", 7, first_without_tensors=first_without_tensors)
    n = len(single.tensor_names())
    assert len(paths) == -(-n // 7) + first_without_tensors
    assert [p.name for p in paths] == [f"tiny-{i:05d}-of-{len(paths):05d}.gguf" for i in range(1, len(paths) + 1)]
    for given in paths:
        split = GGUFFile(given)
        assert split.path == paths[0] and split.shard_paths == paths
        assert split.get(SPLIT_COUNT) == len(paths) and split.get(SPLIT_TENSORS_COUNT) == n
        _same_model(split, single)
        # Tensors are views of each shard's own mapping, never copies.
        entry = split.tensor(split.tensor_names()[-1])
        assert not entry.data.flags.owndata and not entry.data.flags.writeable


def test_a_one_file_split_is_an_ordinary_model(tmp_path: Path) -> None:
    src = tiny_model_path("qwen3")
    (path,) = write_split(src, tmp_path / "one", 10_000)
    assert path.name == "one-00001-of-00001.gguf"
    _same_model(GGUFFile(path), GGUFFile(src))


@pytest.mark.skipif(gguf_split_tool() is None, reason="llama-gguf-split not found ($SPEKULA_LLAMA_GGUF_SPLIT, "
                    "beside $SPEKULA_LLAMA_SERVER, or on PATH)")
@pytest.mark.parametrize("first_without_tensors", [False, True])
def test_writer_makes_what_llama_gguf_split_makes(tmp_path: Path, first_without_tensors: bool) -> None:
    src = tiny_model_path("qwen2", weight_type="Q4_K")
    tool = gguf_split_tool()
    assert tool is not None
    (tmp_path / "theirs").mkdir()
    (tmp_path / "ours").mkdir()
    theirs = split_with_tool(tool, src, tmp_path / "theirs" / "m", 5, first_without_tensors=first_without_tensors)
    ours = write_split(src, tmp_path / "ours" / "m", 5, first_without_tensors=first_without_tensors)
    assert [p.name for p in ours] == [p.name for p in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name
    _same_model(GGUFFile(theirs[-1]), GGUFFile(src))
    _same_model(GGUFFile(ours[1]), GGUFFile(src))


# --- bad sets: one ModelFileError naming the file -------------------------------------------------

@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    return write_split(tiny_model_path("llama"), tmp_path / "set" / "m", 10)


def _raises(path: Path, *fragments: str) -> str:
    with pytest.raises(ModelFileError) as info:
        GGUFFile(path)
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, text
    return text


def test_missing_shard_is_named(shards: list[Path]) -> None:
    shards[1].unlink()
    for given in (shards[0], shards[-1]):
        _raises(given, str(shards[1]), f"missing: shard 2 of the {len(shards)}-file split model")


def test_shard_of_another_set_is_refused(shards: list[Path], tmp_path: Path) -> None:
    # Another model split the same number of ways, with a different tensor count.
    big = build("llama", tmp_path / "big.gguf", n_layer=5)
    per_shard = -(-len(GGUFFile(big).tensor_names()) // len(shards))
    bigger = write_split(big, tmp_path / "big" / "m", per_shard)
    assert len(bigger) == len(shards)
    shutil.copy(bigger[1], shards[1])
    _raises(shards[0], str(shards[1]), SPLIT_TENSORS_COUNT, "another split model")


def test_count_mismatch_is_refused(shards: list[Path], tmp_path: Path) -> None:
    # A shard of the same model split fewer ways, renamed into this set.
    fewer = write_split(tiny_model_path("llama"), tmp_path / "fewer" / "m", 13)
    shutil.copy(fewer[1], shards[1])
    _raises(shards[0], str(shards[1]), f"{SPLIT_COUNT} is {len(fewer)}", f"first shard says {len(shards)}")


def test_shards_swapped_by_renaming_are_refused(shards: list[Path]) -> None:
    a, b = shards[1], shards[2]
    tmp = a.with_name("tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    _raises(shards[0], str(a), f"{SPLIT_NO} is 2 where shard 1 was expected")


def test_duplicated_tensor_is_refused(shards: list[Path]) -> None:
    # Shard 3 renamed into shard 2's place with its split.no patched: shards 2 and 3 hold the same tensors.
    data = bytearray(shards[2].read_bytes())
    key = SPLIT_NO.encode()
    at = data.index(key) + len(key) + 4  # after the key and its value type (u16)
    assert struct.unpack_from("<H", data, at)[0] == 2
    struct.pack_into("<H", data, at, 1)
    shards[1].write_bytes(bytes(data))
    _raises(shards[0], str(shards[2]), "duplicated tensor", f"shard {shards[1].name} holds it too")


def test_renamed_shard_cannot_find_its_set(shards: list[Path]) -> None:
    renamed = shards[0].with_name("model.gguf")
    shards[0].rename(renamed)
    _raises(renamed, str(renamed), "is shard 1 of a split model", "-00001-of-0000")


def test_tensor_total_mismatch_is_refused(shards: list[Path]) -> None:
    shards[-1].unlink()
    # The last shard's tensors gone, and split.count lowered everywhere: the first shard's total no longer holds.
    n = len(shards) - 1
    for i, path in enumerate(shards[:-1]):
        data = bytearray(path.read_bytes())
        key = SPLIT_COUNT.encode()
        at = data.index(key) + len(key) + 4
        struct.pack_into("<H", data, at, n)
        path.with_name(f"m-{i + 1:05d}-of-{n:05d}.gguf").write_bytes(bytes(data))
    first = shards[0].with_name(f"m-00001-of-{n:05d}.gguf")
    _raises(first, str(first), f"{SPLIT_TENSORS_COUNT} is", "but the shards hold")


def test_rewriting_tools_refuse_split_sets(shards: list[Path]) -> None:
    with pytest.raises(ModelFileError, match="llama-gguf-split --merge"):
        GGUFFile(shards[0])._reader  # noqa: B018 - the property is what refuses
