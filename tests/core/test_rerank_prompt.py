"""How a (query, document) pair becomes a reranker's tokens: the file's rerank template, else
BOS, query, EOS, SEP, document, EOS where the vocabulary adds each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.rerank_prompt import RerankFormat
from spekula.core.modelfile.tokenizer import Tokenizer

calls: list[tuple[str, bool, bool]] = []


async def _encode(text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
    calls.append((text, add_special, parse_special))
    return [ord(c) for c in text]


@pytest.mark.anyio
async def test_template_fills_query_and_document_and_parses_special_tokens() -> None:
    calls.clear()
    fmt = RerankFormat(template="<q>{query}</q><d>{document}</d>", bos=1, eos=2, sep=3)
    assert await fmt.tokens("ab", "c", _encode) == [ord(c) for c in "<q>ab</q><d>c</d>"]
    assert calls == [("<q>ab</q><d>c</d>", False, True)]  # nothing added, specials parsed


@pytest.mark.anyio
@pytest.mark.parametrize("fmt,want", [
    (RerankFormat(bos=1, eos=2, sep=3), [1, 97, 2, 3, 98, 2]),
    (RerankFormat(bos=1), [1, 97, 98]),
    (RerankFormat(), [97, 98]),
    (RerankFormat(sep=3), [97, 3, 98]),
])
async def test_pair_layout_without_a_template(fmt: RerankFormat, want: list[int]) -> None:
    calls.clear()
    assert await fmt.tokens("a", "b", _encode) == want
    assert all(not add and not parse for _, add, parse in calls)  # the texts' own specials stay text


def test_read_from_the_model_file(tmp_path: Path) -> None:
    from spekula.fixtures.tiny_gguf import write_gguf
    from spekula.fixtures.tiny_reranker import tiny_qwen3_reranker_path

    f = GGUFFile(tiny_qwen3_reranker_path())
    assert RerankFormat.from_gguf(f, Tokenizer.from_gguf(f)) == RerankFormat()  # adds neither BOS nor EOS
    meta: dict[str, Any] = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    meta |= {"tokenizer.chat_template.rerank": "Q: {query} D: {document}", "tokenizer.ggml.add_eos_token": True,
             "tokenizer.ggml.add_sep_token": True, "tokenizer.ggml.seperator_token_id": 7}
    path = write_gguf(tmp_path / "r.gguf", "qwen3", {}, {"token_embd.weight": np.zeros((4, 4), np.float32)}, meta)
    g = GGUFFile(path)
    tok = Tokenizer.from_gguf(g)
    assert RerankFormat.from_gguf(g, tok) == RerankFormat(template="Q: {query} D: {document}", eos=tok.eos_id, sep=7)
