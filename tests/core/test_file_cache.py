"""The header cache (core/modelfile/file_cache.py): a GGUF header and the tokenizer derived from it
come back from disk exactly as parsing and deriving them gives, and only for the very same file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from spekula.core.modelfile import file_cache, gguf_file, tokenizer
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.fixtures.tiny_gguf import tiny_model_path, write_gguf
from spekula.fixtures.tiny_spm import spm_tokenizer_metadata

TEXTS = ("the cat sat on the mat", "Hello world! 12345", "<|im_start|>user\nhi<|im_end|>", "  spaces\tand\nlines ")


@pytest.fixture(autouse=True)
def cache_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache dir, and every header and vocabulary cached however small (the fixtures are tiny)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(root))
    monkeypatch.setattr(gguf_file, "CACHE_MIN_HEADER_BYTES", 0)
    monkeypatch.setattr(tokenizer, "CACHE_MIN_VOCAB", 0)
    return root / "headers"


def copy_of(src: Path, tmp_path: Path, name: str = "model.gguf") -> Path:
    dst = tmp_path / name
    shutil.copyfile(src, dst)
    return dst


def no_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: GGUFFile) -> int:
        raise AssertionError("parsed the header although the cache has it")

    monkeypatch.setattr(GGUFFile, "_parse_header", refuse)


def same_header(a: GGUFFile, b: GGUFFile) -> None:
    assert a.metadata == b.metadata
    assert {k: a.value_type(k) for k in a.metadata} == {k: b.value_type(k) for k in b.metadata}
    assert a.tensor_names() == b.tensor_names()
    for name in a.tensor_names():
        ta, tb = a.tensor(name), b.tensor(name)
        assert (ta.type_name, ta.shape) == (tb.type_name, tb.shape)
        assert np.array_equal(ta.data, tb.data)


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = a.encode(text, add_special=special, parse_special=special)
            assert ids == b.encode(text, add_special=special, parse_special=special)
            assert a.decode(ids) == b.decode(ids)
    assert [a.token_bytes(i) for i in range(a.n_vocab)] == [b.token_bytes(i) for i in range(b.n_vocab)]
    assert [a.token_type(i) for i in range(a.n_vocab)] == [b.token_type(i) for i in range(b.n_vocab)]
    assert (a.eog_ids, a.fim, a.bos_id, a.eos_id, a.add_bos) == (b.eog_ids, b.fim, b.bos_id, b.eos_id, b.add_bos)


def test_second_open_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_everything: Path) -> None:
    path = copy_of(tiny_model_path("llama", fim=True), tmp_path)
    parsed = GGUFFile(path)
    fresh_tok = Tokenizer.from_gguf(parsed)
    assert sorted(p.name.split("-")[0] for p in cache_everything.iterdir()) == ["gguf", "tokenizer"]
    no_parsing(monkeypatch)
    cached = GGUFFile(path)
    same_header(parsed, cached)
    same_tokenizer(fresh_tok, Tokenizer.from_gguf(cached))
    same_tokenizer(fresh_tok, Tokenizer(parsed.metadata))  # no identity: derived afresh


def test_sentencepiece_vocabulary_from_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "spm.gguf"
    write_gguf(path, "llama", {"block_count": 1}, {"x": np.zeros(32, np.float32)}, spm_tokenizer_metadata())
    fresh = Tokenizer.from_gguf(GGUFFile(path))
    cached = Tokenizer.from_gguf(GGUFFile(path))
    same_tokenizer(fresh, cached)
    assert cached._add_space_prefix and cached.model_kind == "llama"


def test_a_changed_file_is_parsed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = copy_of(tiny_model_path("llama"), tmp_path)
    GGUFFile(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    calls: list[int] = []
    parse = GGUFFile._parse_header

    def counting(self: GGUFFile) -> int:
        calls.append(1)
        return parse(self)

    monkeypatch.setattr(GGUFFile, "_parse_header", counting)
    GGUFFile(path)
    assert calls == [1]


def test_a_damaged_entry_is_a_miss(tmp_path: Path, cache_everything: Path) -> None:
    path = copy_of(tiny_model_path("llama"), tmp_path)
    parsed = GGUFFile(path)
    tok = Tokenizer.from_gguf(parsed)
    for entry in cache_everything.iterdir():
        entry.write_bytes(entry.read_bytes()[:100])
    reopened = GGUFFile(path)
    same_header(parsed, reopened)
    same_tokenizer(tok, Tokenizer.from_gguf(reopened))


def test_an_entry_of_other_code_is_a_miss(tmp_path: Path) -> None:
    identity = file_cache.file_identity(copy_of(tiny_model_path("llama"), tmp_path))
    file_cache.store("x", identity, "code-1", {"a": [1, 2]})
    assert file_cache.load("x", identity, "code-1") == {"a": [1, 2]}
    assert file_cache.load("x", identity, "code-2") is None
    assert file_cache.load("x", None, "code-1") is None
    file_cache.store("x", identity, "code-2", {"b": 3})  # another version's entry leaves this one in place
    assert file_cache.load("x", identity, "code-1") == {"a": [1, 2]}
    assert file_cache.load("x", identity, "code-2") == {"b": 3}


def test_only_the_newest_entries_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_everything: Path) -> None:
    monkeypatch.setattr(file_cache, "MAX_ENTRIES", 2)
    for i in range(4):
        identity = file_cache.file_identity(copy_of(tiny_model_path("llama"), tmp_path, f"m{i}.gguf"))
        file_cache.store("x", identity, "c", i)
    assert len(list(cache_everything.iterdir())) == 2


def test_an_unwritable_cache_caches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache dir would go")
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(blocker))
    path = copy_of(tiny_model_path("llama"), tmp_path)
    first = GGUFFile(path)
    same_header(first, GGUFFile(path))
    same_tokenizer(Tokenizer.from_gguf(first), Tokenizer.from_gguf(first))
