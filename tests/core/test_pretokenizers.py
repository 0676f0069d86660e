"""o200k's (``gpt-4o``, gpt-oss) and tekken's (Mistral, Ministral 3) pre-tokenizers against llama.cpp.

llama.cpp's sdist has no test vectors for either, so a small byte-level vocabulary stands in: merges
that cross a camel-case boundary, join a contraction to its word or group digits, and a whole word with
no merges (taken whole only where llama.cpp ignores merges, as for tekken). The expected ids are what
llama.cpp's llama-tokenize (build 11434) gives for this vocabulary under each pre-tokenizer name."""

from __future__ import annotations

from typing import Any

import pytest
from byte_vocab import BYTE_CHAR, byte_level_vocab

from spekula.core.errors import ModelFileError
from spekula.core.modelfile.tokenizer import Tokenizer

# ids: 0 a control token, 1..256 the byte symbols, then one token per merge (257..265), then "World" (266)
_MERGES = (("o", "W"), ("c", "D"), ("e", "'"), ("e'", "s"), ("1", "2"), ("12", "3"), ("123", "4"),
           (BYTE_CHAR[32], "/"), ("Ã", "©"))
_WHOLE_WORDS = ("World",)


def _case_vocab(pre: str) -> dict[str, Any]:
    return byte_level_vocab(pre, _MERGES, _WHOLE_WORDS, add_bos_token=False)


# text -> llama-tokenize's ids under gpt-4o, tekken, and qwen2 (a pre-tokenizer without case splits)
CASES = {
    "HelloWorld": ([73, 102, 109, 109, 112, 88, 112, 115, 109, 101], [73, 102, 109, 109, 112, 266],
                   [73, 102, 109, 109, 257, 112, 115, 109, 101]),
    "abcDEF": ([98, 99, 100, 69, 70, 71], [98, 99, 100, 69, 70, 71], [98, 99, 258, 70, 71]),
    "He's": ([73, 260], [73, 102, 40, 116], [73, 102, 40, 116]),
    "HE'S they'd": ([73, 70, 40, 84, 33, 117, 105, 102, 122, 40, 101],) * 3,
    "12345678": ([262, 53, 54, 55, 56, 57], [50, 51, 52, 53, 54, 55, 56, 57], [50, 51, 52, 53, 54, 55, 56, 57]),
    "a /b": ([98, 264, 99],) * 3,
    "\u00e9A \u00c9\u00e9": ([265, 66, 33, 196, 138, 265],) * 3,
    "\u00c9COLE\u00e9cole": ([196, 138, 68, 80, 77, 70, 265, 100, 112, 109, 102],) * 3,
    "x\u0301W": ([121, 205, 130, 88],) * 3,
    "World!": ([88, 112, 115, 109, 101, 34], [266, 34], [88, 112, 115, 109, 101, 34]),
}  # fmt: skip


@pytest.mark.parametrize("text", list(CASES))
@pytest.mark.parametrize(("pre", "column"), [("gpt-4o", 0), ("tekken", 1), ("qwen2", 2)])
def test_case_splitting_pre_tokenizers_match_llamacpp(text: str, pre: str, column: int) -> None:
    assert Tokenizer(_case_vocab(pre)).encode(text, add_special=False, parse_special=False) == CASES[text][column]


def test_tekken_adds_bos_by_default() -> None:
    meta = _case_vocab("tekken")
    del meta["tokenizer.ggml.add_bos_token"]
    assert Tokenizer(meta).encode("He's")[0] == 0
    meta["tokenizer.ggml.pre"] = "gpt-4o"
    assert Tokenizer(meta).encode("He's") == [73, 260]


def test_unknown_pre_tokenizer_is_refused() -> None:
    with pytest.raises(ModelFileError, match="unsupported pre-tokenizer 'o200k'"):
        Tokenizer(_case_vocab("o200k"))
