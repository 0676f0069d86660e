"""`spekula truncate-model`: first K blocks copied byte for byte, metadata types kept, clear errors."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import gguf
import numpy as np
import pytest
from output_paths import UNWRITABLE, unwritable_output

from spekula.backends.convert.truncate import truncate_gguf
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.drafters.model.draft_simple import check_vocab_compatible
from spekula.fixtures.tiny_gguf import tiny_model_path, write_gguf
from spekula.frontends.cli.main import main


def field_types(path: Path) -> dict[str, list[int]]:
    r = gguf.GGUFReader(str(path), "r")
    return {k: [int(t) for t in f.types] for k, f in r.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_truncated_copy(tmp_path: Path, arch: str) -> None:
    src = tiny_model_path(arch)
    dst = tmp_path / "draft.gguf"
    res = truncate_gguf(src, dst, 2)
    assert (res.n_layer_in, res.n_layer_out) == (4, 2)
    a, b = GGUFFile(src), GGUFFile(dst)
    assert b.get(f"{arch}.block_count") == 2
    assert b.get("general.name") == f"{a.get('general.name')} (first 2 of 4 layers)"
    expect = [n for n in a.tensor_names() if not n.startswith(("blk.2.", "blk.3."))]
    assert b.tensor_names() == expect and "output_norm.weight" in expect
    for name in expect:
        ta, tb = a.tensor(name), b.tensor(name)
        assert (ta.type_name, ta.shape) == (tb.type_name, tb.shape)
        assert np.array_equal(np.asarray(ta.data).view(np.uint8), np.asarray(tb.data).view(np.uint8))
    for key, value in a.metadata.items():
        if key not in (f"{arch}.block_count", "general.name"):
            assert b.metadata[key] == value, key
    assert field_types(src) == field_types(dst)
    # The copy is a valid draft model for its source: same vocabulary.
    check_vocab_compatible(Tokenizer.from_gguf(a), Tokenizer.from_gguf(b), str(src), str(dst))


def test_per_layer_arrays_are_cut(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": np.ones((8, 4), np.float32), "output_norm.weight": np.ones(4, np.float32)}
    for i in range(3):
        tensors[f"blk.{i}.attn_norm.weight"] = np.full(4, i, np.float32)
    src = write_gguf(tmp_path / "in.gguf", "llama",
                     {"block_count": 3, "attention.head_count_kv": [2, 2, 1], "embedding_length": 4},
                     tensors, {"general.name": "toy"})
    truncate_gguf(src, tmp_path / "out.gguf", 2)
    out = GGUFFile(tmp_path / "out.gguf")
    assert out.get("llama.attention.head_count_kv") == [2, 2]
    assert out.get("llama.embedding_length") == 4
    assert out.tensor_names() == ["token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight",
                                  "blk.1.attn_norm.weight"]


def test_errors(tmp_path: Path) -> None:
    src = tiny_model_path("llama")
    for k in (0, 5, -1):
        with pytest.raises(ConfigError, match=r"--layers must be in \[1, 4\]"):
            truncate_gguf(src, tmp_path / "x.gguf", k)
    with pytest.raises(ConfigError, match="is the input file"):
        truncate_gguf(src, src, 2)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        truncate_gguf(bad, tmp_path / "y.gguf", 1)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "y.gguf").exists()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.gguf"
    assert main(["truncate-model", str(tiny_model_path("llama")), "--layers", "1", "-o", str(out)]) == 0
    assert GGUFFile(out).get("llama.block_count") == 1
    assert "1 of 4 layers" in capsys.readouterr().err
    assert main(["truncate-model", str(tiny_model_path("llama")), "--layers", "9", "-o", str(out)]) == 1
    assert "spekula: error: --layers must be in [1, 4]" in capsys.readouterr().err


@pytest.mark.parametrize("where", UNWRITABLE)
def test_unwritable_output_is_one_clear_error(tmp_path: Path, where: str) -> None:
    """-o naming a directory or a path below a regular file: a ConfigError naming the path (these were
    IsADirectoryError / FileExistsError tracebacks), and nothing created or changed."""
    blocker, target, needle = unwritable_output(tmp_path, where, "d.gguf")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="-o") as info:
        truncate_gguf(tiny_model_path("llama"), target, 1)
    assert needle in str(info.value) and str(target) in str(info.value)
    assert sorted(tmp_path.rglob("*")) == before
    if where != "directory":
        assert blocker.read_text() == "keep me"


def test_cli_unwritable_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["truncate-model", str(tiny_model_path("llama")), "--layers", "1", "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("spekula: error: -o ") and "is a directory" in err and "Traceback" not in err


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_output_mode_follows_the_umask(tmp_path: Path, umask: int) -> None:
    """The copy is an ordinary user file (0644 under the usual umask), as `convert` writes, not the
    0600 of a private temporary file; missing parent folders are created."""
    old = os.umask(umask)
    try:
        out = truncate_gguf(tiny_model_path("llama"), tmp_path / "sub" / "d.gguf", 1).path
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in out.parent.iterdir()] == ["d.gguf"]


def test_write_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: gguf.GGUFWriter, *args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full_disk)
    with pytest.raises(ConfigError, match="cannot write -o .*d.gguf: No space left on device"):
        truncate_gguf(tiny_model_path("llama"), tmp_path / "d.gguf", 1)
    assert list(tmp_path.iterdir()) == []
