"""The tokenizer against llama.cpp's own test vectors: every ``models/ggml-vocab-<name>.gguf`` of the
llama.cpp sdist that has ``.inp``/``.out`` files, read the way llama.cpp's tests/test-tokenizer-0.cpp
reads them (inputs separated by a marker line, one line of expected ids each, tokenized without BOS/EOS
and without parsing special tokens).

llama.cpp's ``ggml-vocab-qwen35.gguf`` holds Qwen2's vocabulary, whose merges never cross a letter/mark
boundary, so its vectors pass with the qwen2 regex too; the synthetic vocabulary below has such merges,
and pins what the qwen35 regex's ``[\\p{L}\\p{M}]+`` letter runs change."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import pytest
from byte_vocab import byte_level, byte_level_vocab
from llamacpp_sdist import ROOT, sdist_path

from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer

SUPPORTED = ("bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "llama-spm",
             "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")
# Vocabularies with vectors whose tokenizer model or pre-tokenizer spekula does not implement: their
# test checks that the tokenizer refuses them, then skips naming them.
UNSUPPORTED: tuple[str, ...] = ()
_VOCAB_PREFIX = ROOT + "models/ggml-vocab-"
_SEPARATOR = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/ggml-vocab-* of the sdist, extracted (the GGUFs are binary, read_source reads text only)."""
    out = tmp_path_factory.mktemp("ggml-vocab")
    with tarfile.open(sdist_path()) as tar:
        for member in tar:
            if member.isfile() and member.name.startswith(_VOCAB_PREFIX):
                data = tar.extractfile(member)
                assert data is not None, member.name
                (out / Path(member.name).name).write_bytes(data.read())
    return out


def read_vectors(inp: bytes, out: str) -> dict[str, list[int]]:
    """input text -> expected ids, as test-tokenizer-0.cpp's read_tests builds them (a later duplicate
    input replaces an earlier one, as in its std::map; no empty input after a trailing marker)."""
    raw = inp.decode("utf-8")  # bytes: text mode would fold the vectors' "\r\n" into "\n"
    inputs: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(_SEPARATOR, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(_SEPARATOR)
    lines = out.split("\n")
    if lines and lines[-1] == "":  # getline yields no line after the final newline
        lines.pop()
    assert len(inputs) == len(lines), f"{len(inputs)} inputs for {len(lines)} expected lines"
    return {text: [int(t) for t in line.strip().split(" ") if t] for text, line in zip(inputs, lines, strict=True)}


def test_every_vocab_with_vectors_is_listed(vocab_dir: Path) -> None:
    with_vectors = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp") for p in vocab_dir.glob("*.gguf.inp")}
    assert with_vectors == set(SUPPORTED) | set(UNSUPPORTED)


@pytest.mark.parametrize("name", SUPPORTED + UNSUPPORTED)
def test_llamacpp_vectors(vocab_dir: Path, name: str) -> None:
    path = vocab_dir / f"ggml-vocab-{name}.gguf"
    meta = GGUFFile(path).metadata
    if name in UNSUPPORTED:
        with pytest.raises(ModelFileError, match="unsupported") as refused:
            Tokenizer(meta, source=path)
        pytest.skip(f"ggml-vocab-{name}: not supported by spekula's tokenizer ({refused.value})")
    # built from the metadata alone: a vocabulary in a temporary folder stays out of the header cache
    tok = Tokenizer(meta, source=path)
    vectors = read_vectors((vocab_dir / f"{path.name}.inp").read_bytes(), (vocab_dir / f"{path.name}.out").read_text())
    assert len(vectors) > 20
    failed = {text: (expected, got) for text, expected in vectors.items()
              if (got := tok.encode(text, add_special=False, parse_special=False)) != expected}
    assert not failed, f"{len(failed)} of {len(vectors)} vectors differ (text: (expected, got)): {failed}"


def test_read_vectors_follows_llamacpp() -> None:
    inp = "a\r\nb\n__ggml_vocab_test__\n\n__ggml_vocab_test__\nx\n__ggml_vocab_test__\na\r\nb\n__ggml_vocab_test__\n"
    assert read_vectors(inp.encode(), " 1 2 \n\n3\n1 2\n") == {"a\r\nb": [1, 2], "": [], "x": [3]}


# ---- letter + combining-mark runs (qwen35) -------------------------------------------------------

_ACUTE = byte_level("\u0301")  # COMBINING ACUTE ACCENT, a \p{Mn}: two byte symbols
# ids: 0 a control token, 1..256 the byte symbols, then one token per merge in this order (257..262)
_MERGES = ((_ACUTE[0], _ACUTE[1]), ("e", _ACUTE), ("c", "a"), ("ca", "f"), ("caf", "e" + _ACUTE),
           (byte_level(" "), "ca"))


def _mark_vocab(pre: str) -> dict[str, Any]:
    return byte_level_vocab(pre, _MERGES)


# What llama.cpp's llama-tokenize (build 11434) gives for this vocabulary under each pre-tokenizer.
# qwen35 keeps a combining mark in the letter run before it; qwen2 splits it off into a punctuation
# run, so the "caf"+"e\u0301" merge never applies.
MARK_CASES = [
    ("cafe\u0301", [261], [260, 102, 257]),
    ("a cafe\u0301!", [98, 33, 261, 34], [98, 33, 260, 102, 257, 34]),
    ("x \u0301e", [121, 33, 257, 102], [121, 33, 257, 102]),
    ("!\u0301\u0301", [34, 257, 257], [34, 257, 257]),
    ("e\u0301\u0301 \u0301", [258, 257, 33, 257], [102, 257, 257, 33, 257]),
]


@pytest.mark.parametrize(("text", "qwen35_ids", "qwen2_ids"), MARK_CASES)
def test_qwen35_letter_runs_take_combining_marks(text: str, qwen35_ids: list[int], qwen2_ids: list[int]) -> None:
    assert Tokenizer(_mark_vocab("qwen35")).encode(text, add_special=False) == qwen35_ids
    assert Tokenizer(_mark_vocab("qwen2")).encode(text, add_special=False) == qwen2_ids


# ---- Gemma 4: special tokens, BOS and decoding ---------------------------------------------------

GEMMA4_PROMPT = "<|turn>user\nHello  w\u00f6rld\n\n\n\u65e5\u672c </s> <turn|>\n<|turn>model\n<|channel>thought\n"
# llama-tokenize -m ggml-vocab-gemma-4.gguf (build 11434), special tokens parsed, BOS added
GEMMA4_IDS = [2, 105, 2364, 107, 9259, 138, 236765, 4010, 671, 109, 10956, 1454, 236751, 236813, 236743, 106, 107,
              105, 4368, 107, 100, 45518, 107]


def test_gemma4_specials_bos_and_decoding(vocab_dir: Path) -> None:
    meta = dict(GGUFFile(vocab_dir / "ggml-vocab-gemma-4.gguf").metadata)
    meta["tokenizer.ggml.add_bos_token"] = False  # llama.cpp adds BOS for Gemma 4 whatever the file says
    tok = Tokenizer(meta)
    assert tok.encode(GEMMA4_PROMPT) == GEMMA4_IDS
    assert tok.decode(GEMMA4_IDS) == "<bos>" + GEMMA4_PROMPT  # "</s>" is plain text here, not a control token
    assert {tok.token_text(t) for t in tok.eog_ids} == {"<eos>", "<turn|>", "<|tool_response>"}
    # a character the vocabulary lacks falls back to its UTF-8 bytes as <0xNN> tokens, and decodes back
    rare = "\U0010fffd"  # llama-tokenize: [482, 381, 429, 427]
    ids = tok.encode(rare, add_special=False)
    assert ids == [482, 381, 429, 427]
    assert [tok.token_text(t) for t in ids] == [f"<0x{b:02X}>" for b in rare.encode()]
    assert tok.decode(ids) == rare


# ---- WordPiece (bert-bge): what the vectors do not cover ------------------------------------------

# llama-tokenize -m ggml-vocab-bert-bge.gguf (build 11434): without specials, then with them
BGE_CASES = [
    ("\ud55c\uad6d\uc5b4", [1469, 29991, 29999]),  # a Hangul syllable keeps only its first jamo (one-code-point NFD)
    ("\u0130stanbul", [9960]),  # the simple lower case of U+0130 is "i"
    ("a\x1fb", [11113]),  # \\p{C} is dropped, not a word break
]


@pytest.mark.parametrize(("text", "ids"), BGE_CASES)
def test_bert_wordpiece_follows_llamacpp(vocab_dir: Path, text: str, ids: list[int]) -> None:
    tok = Tokenizer(GGUFFile(vocab_dir / "ggml-vocab-bert-bge.gguf").metadata)
    assert tok.encode(text, add_special=False) == ids


def test_bert_adds_cls_and_sep(vocab_dir: Path) -> None:
    tok = Tokenizer(GGUFFile(vocab_dir / "ggml-vocab-bert-bge.gguf").metadata)
    assert tok.encode("hello hello hello") == [101, 7592, 7592, 7592, 102]
    assert tok.encode("[CLS] hi [SEP]", add_special=False) == [101, 7632, 102]  # control tokens parsed


@pytest.mark.parametrize(("raw", "clean"), [
    (b" hello , world ! ok ? yes .", b" hello, world! ok? yes."),  # pass 1: no space before ?!.,
    (b" a ' b", b" a'b"),  # pass 2: a lone apostrophe loses both spaces
    (b" it 's i 'm we 're you 've", b" it's i'm we're you've"),  # pass 3: these contractions join
    (b" don 't i 'd we 'll", b" don 't i 'd we 'll"),  # ... and these do not (llama.cpp leaves them)
    (b"", b""),
])
def test_wordpiece_detokenize_cleans_spaces_as_llamacpp(raw: bytes, clean: bytes) -> None:
    from spekula.core.modelfile.wordpiece import clean_spaces

    assert clean_spaces(raw) == clean


def test_bert_decode_joins_pieces(vocab_dir: Path) -> None:
    tok = Tokenizer(GGUFFile(vocab_dir / "ggml-vocab-bert-bge.gguf").metadata)
    assert tok.decode(tok.encode("Hello, world! It's fine.", add_special=False)) == " hello, world! it's fine."


@pytest.mark.parametrize("name", ["gpt-2", "llama-spm", "gemma-4", "bert-bge"])
def test_vectors_through_the_header_cache(vocab_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          name: str) -> None:
    """A vocabulary of each kind (byte-level BPE, SentencePiece, Gemma 4's, WordPiece) opened twice with
    an empty cache dir: the first open derives the tables and leaves them in the header cache, the
    second takes them from it, and both encode llama.cpp's vectors as llama.cpp does."""
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"ggml-vocab-{name}.gguf"
    path.write_bytes((vocab_dir / path.name).read_bytes())
    vectors = read_vectors((vocab_dir / f"{path.name}.inp").read_bytes(), (vocab_dir / f"{path.name}.out").read_text())
    cold = Tokenizer.from_gguf(GGUFFile(path))
    assert len(list((tmp_path / "cache" / "headers").glob("tokenizer-*"))) == 1

    def refuse(*_: Any) -> None:
        raise AssertionError("derived the vocabulary's tables although the header cache has them")

    monkeypatch.setattr(Tokenizer, "_derive", refuse)
    warm = Tokenizer.from_gguf(GGUFFile(path))
    for tok in (cold, warm):
        failed = {text: (expected, got) for text, expected in vectors.items()
                  if (got := tok.encode(text, add_special=False, parse_special=False)) != expected}
        assert not failed, f"{len(failed)} of {len(vectors)} vectors differ (text: (expected, got)): {failed}"
    for text in ("<start_of_turn>user\nhi\n\n\n<end_of_turn>", "[CLS] a\tb [SEP]", " x \n\n y"):
        ids = cold.encode(text)
        assert warm.encode(text) == ids and warm.decode(ids) == cold.decode(ids)
    assert (warm.eog_ids, warm.fim, warm.bos_id, warm.eos_id) == (cold.eog_ids, cold.fim, cold.bos_id, cold.eos_id)
