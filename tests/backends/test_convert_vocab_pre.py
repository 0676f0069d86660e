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
