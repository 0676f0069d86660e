"""Large header arrays stay compact (StringArray, NumberArray) and token pieces live in one buffer
(PieceTable): each reads back exactly what lists of the same items give, from a parse and from the cache."""

from __future__ import annotations

import pickle
import random
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from backend_conformance import smollm2_path

from spekula.core.modelfile import file_cache
from spekula.core.modelfile.gguf_arrays import (
    CACHE_TAG,
    LAZY_MIN_ITEMS,
    NumberArray,
    StringArray,
    cache_form,
    from_cache_form,
    read_strings,
)
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.token_pieces import PieceTable
from spekula.core.modelfile.tokenizer import Tokenizer

WORDS = ["", "a", "héllo", "\u2581the", "<|im_end|>", "x" * 300, "日本語"]


def _packed(words: list[str]) -> bytes:
    return b"".join(struct.pack("<Q", len(w.encode())) + w.encode() for w in words)


def test_string_array_reads_as_the_list() -> None:
    raw = b"junk" + _packed(WORDS) + b"tail"
    read = read_strings(raw, 4, len(WORDS))
    assert read is not None
    arr, end = read
    assert end == len(raw) - 4
    assert len(arr) == len(WORDS) and list(arr) == WORDS and arr == WORDS
    assert WORDS == arr  # noqa: SIM300 - a list on the left: the reflected comparison
    assert [arr[i] for i in range(-len(WORDS), len(WORDS))] == WORDS + WORDS
    assert arr[1:4] == WORDS[1:4] and arr[::-2] == WORDS[::-2]
    assert arr != WORDS[:-1] and arr != [*WORDS[:-1], "other"]
    with pytest.raises(IndexError):
        arr[len(WORDS)]
    assert "héllo" in arr and arr.index("<|im_end|>") == 4
    assert from_cache_form(arr.to_cache()) == arr
    assert pickle.loads(pickle.dumps(arr)) == WORDS  # engines travel to Ray replicas pickled


@pytest.mark.parametrize("dtype", ["<f4", "<i4", "<u1", "<i8"])
def test_number_array_reads_as_the_list(dtype: str) -> None:
    values = (np.arange(-5, 300) / 3 if dtype == "<f4" else np.arange(-5, 300) % 200).astype(dtype)
    want = values.tolist()
    arr = NumberArray(values)
    assert len(arr) == len(want) and list(arr) == want and arr == want
    assert want == arr  # noqa: SIM300 - a list on the left: the reflected comparison
    assert type(arr[0]) is type(want[0]) and arr[-1] == want[-1] and arr[3:9] == want[3:9]
    assert arr != want[:-1] and arr != [*want[:-1], 12345]
    assert from_cache_form(cache_form(arr)) == want and pickle.loads(pickle.dumps(arr)) == want
    with pytest.raises(IndexError):
        arr[len(want)]


def test_truncated_or_invalid_strings() -> None:
    raw = _packed(WORDS)
    assert read_strings(raw[:-1], 0, len(WORDS)) is None
    assert read_strings(raw, 0, len(WORDS) + 1) is None
    bad = struct.pack("<Q", 2) + b"\xff\xfe"
    read = read_strings(bad, 0, 1)
    assert read is not None and read[0][0] == b"\xff\xfe".decode("utf-8", errors="replace")
    with pytest.raises(ValueError):
        from_cache_form((CACHE_TAG, b"ab", b"\x00"))


def test_piece_table() -> None:
    pieces = [w.encode() for w in WORDS]
    table = PieceTable.from_pieces(pieces)
    assert len(table) == len(pieces) and [table[i] for i in range(len(pieces))] == pieces
    skip = bytes([0, 0, 0, 0, 1, 0, 1])
    rng = random.Random(0)
    for n in (0, 3, 255, 256, 2000):  # a slice per id below 256, one numpy gather from there
        ids = [rng.randrange(len(pieces)) for _ in range(n)]
        assert table.concat(ids) == b"".join(pieces[i] for i in ids)
        assert table.concat(ids, skip) == b"".join(b"" if skip[i] else pieces[i] for i in ids)
    for again in (PieceTable.from_cache(*table.to_cache()), pickle.loads(pickle.dumps(table))):
        assert [again[i] for i in range(len(pieces))] == pieces
    with pytest.raises(ValueError):
        PieceTable.from_cache(b"abc", table.to_cache()[1])


def test_large_vocabulary_is_a_string_array_equal_to_gguf_readers(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = smollm2_path()
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path / "cache"))
    ref = gguf.GGUFReader(str(path))
    want = ref.fields["tokenizer.ggml.tokens"].contents()
    assert len(want) >= LAZY_MIN_ITEMS
    cold, warm = GGUFFile(path), GGUFFile(path)  # the second one from the header cache
    assert list(file_cache.cache_root().glob("gguf-header-*"))
    for f in (cold, warm):
        tokens = f.metadata["tokenizer.ggml.tokens"]
        assert isinstance(tokens, StringArray) and tokens == want
        assert f.metadata["tokenizer.ggml.merges"] == ref.fields["tokenizer.ggml.merges"].contents()
        types = f.metadata["tokenizer.ggml.token_type"]
        assert isinstance(types, NumberArray) and types == ref.fields["tokenizer.ggml.token_type"].contents()
    # The tokenizer built over it, cold and from its own cache, keeps no list of the strings and says
    # the same as one built over plain lists.
    plain = {k: list(v) if isinstance(v, StringArray | NumberArray) else v for k, v in cold.metadata.items()}
    ref_tok = Tokenizer(plain)
    text = "Hello, world! <|im_start|>user\nSpeculative décodage 日本語 1234\n<|im_end|>"
    for tok in (Tokenizer.from_gguf(cold), Tokenizer.from_gguf(warm)):
        assert isinstance(tok._tokens, StringArray)
        ids = tok.encode(text)
        assert ids == ref_tok.encode(text)
        assert tok.decode(ids) == ref_tok.decode(ids)
        assert [tok.token_text(i) for i in ids] == [ref_tok.token_text(i) for i in ids]
        assert [tok.token_bytes(i) for i in range(tok.n_vocab)] == [ref_tok.token_bytes(i) for i in range(tok.n_vocab)]
        assert tok.decode(ids, skip_special=True) == ref_tok.decode(ids, skip_special=True)
