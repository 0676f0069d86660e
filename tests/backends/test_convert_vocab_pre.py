"""The converter names a Qwen tokenizer's pre-tokenizer as llama.cpp's converter does.

llama.cpp's convert_hf_to_gguf.py hashes the ids of a fixed text and looks the hash up in
``get_vocab_base_pre`` (conversion/base.py), each entry naming the checkpoint it was taken from; the
hash needs the real vocabulary, so here the name that table gives the reference checkpoint is compared
with what ``infer_pre`` reads off a ``tokenizer.json`` written by that model family's transformers
tokenizer class (same pre-tokenizer, any vocabulary)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from llamacpp_sdist import read_source

from spekula.backends.convert.vocab import infer_pre


def _llamacpp_pre_names() -> dict[str, str]:
    """reference checkpoint (``Qwen/Qwen3.5-9B-Instruct``) -> the pre-tokenizer name llama.cpp gives it."""
    source = read_source("conversion/base.py")
    entries = re.findall(r'if chkhsh == "[0-9a-f]{64}":\s*# ref: https://huggingface\.co/(\S+)\s*res = "([^"]+)"', source)
    assert len(entries) > 50, "get_vocab_base_pre's table not found"
    return dict(entries)


@pytest.mark.parametrize(
    ("module", "class_name", "reference"),
    [
        ("transformers.models.qwen3_5.tokenization_qwen3_5", "Qwen3_5Tokenizer", "Qwen/Qwen3.5-9B-Instruct"),
        ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer", "Qwen/Qwen1.5-7B"),
    ],
)
def test_infer_pre_names_what_llamacpp_names(tmp_path: Path, module: str, class_name: str, reference: str) -> None:
    tokenizer_class = getattr(pytest.importorskip(module), class_name)
    tokenizer_class(vocab={"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3}, merges=[("a", "b")]).save_pretrained(tmp_path)
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert infer_pre(tokenizer_json, tmp_path) == _llamacpp_pre_names()[reference]


def _original_regex(pre_type: str) -> str:
    """The regex of tokenizer.json that llama-vocab.cpp quotes (as "original regex from tokenizer.json")
    above its own form for one pre-tokenizer type."""
    source = read_source("src/llama-vocab.cpp")
    case = source.index(f"case LLAMA_VOCAB_PRE_TYPE_{pre_type}:")
    quoted = re.search(r'original regex from tokenizer\.json\s*// "((?:[^"\\]|\\.)*)"', source[case:])
    assert quoted is not None, pre_type
    return quoted.group(1).encode().decode("unicode_escape")


@pytest.mark.parametrize(
    ("pre_type", "reference"),
    [("GPT4O", "Xenova/gpt-4o"), ("TEKKEN", "mistralai/Mistral-Nemo-Base-2407")],
)
def test_infer_pre_names_o200k_and_tekken(tmp_path: Path, pre_type: str, reference: str) -> None:
    """gpt-oss's tokenizer.json splits with o200k's regex (llama.cpp's converter hashes it to the name of
    GPT-4o's), Ministral 3's with tekken's; both then apply ByteLevel without its own regex."""
    tokenizer_json = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _original_regex(pre_type)}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}}  # fmt: skip
    assert infer_pre(tokenizer_json, tmp_path) == _llamacpp_pre_names()[reference]


def test_sentencepiece_style_bpe_is_refused(tmp_path: Path) -> None:
    """Gemma 4's tokenizer.json is BPE with byte fallback over ``▁`` spaces, which llama.cpp writes as its
    own tokenizer model; the converter refuses it rather than writing a byte-level vocabulary."""
    from spekula.backends.convert.gguf_writer import GGUFOut
    from spekula.backends.convert.vocab import write_vocab
    from spekula.core.errors import ModelFileError

    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {
        "type": "BPE", "byte_fallback": True, "vocab": {"<0x00>": 0, "\u2581a": 1}, "merges": []}}))  # fmt: skip
    with pytest.raises(ModelFileError, match="SentencePiece-style BPE"):
        write_vocab(GGUFOut.__new__(GGUFOut), tmp_path, vocab_size=None, pre="gpt-2")
