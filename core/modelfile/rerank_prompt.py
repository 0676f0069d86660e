"""How a reranker sees a (query, document) pair, as llama-server builds it.

A model with a `tokenizer.chat_template.rerank` template (Qwen3 rerankers) gets that text with
`{query}` and `{document}` filled in, tokenized with special tokens parsed and none added. Any other
gets BOS (when the vocabulary adds one), the query, EOS (when it adds one), SEP (when it adds one), the
document and EOS again; EOS falls back to SEP where the vocabulary has no EOS.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from spekula.core.modelfile.gguf_file import GGUFFile

Encode = Callable[..., Awaitable[list[int]]]


@dataclass(frozen=True, slots=True)
class RerankFormat:
    template: str | None = None
    bos: int | None = None  # added ids; None where the vocabulary does not add that token
    eos: int | None = None
    sep: int | None = None

    @classmethod
    def from_gguf(cls, f: GGUFFile, tokenizer: Any) -> RerankFormat:
        template = f.get("tokenizer.chat_template.rerank")
        sep_id = f.get("tokenizer.ggml.seperator_token_id")  # llama.cpp's spelling of the key
        eos_id = tokenizer.eos_id if tokenizer.eos_id is not None else sep_id
        return cls(template=template if isinstance(template, str) else None,
                   bos=tokenizer.bos_id if tokenizer.add_bos else None,
                   eos=eos_id if tokenizer.add_eos else None,
                   sep=sep_id if bool(f.get("tokenizer.ggml.add_sep_token", False)) else None)

    async def tokens(self, query: str, document: str, encode: Encode) -> list[int]:
        if self.template is not None:
            text = self.template.replace("{query}", query).replace("{document}", document)
            return await encode(text, add_special=False, parse_special=True)
        q = await encode(query, add_special=False, parse_special=False)
        d = await encode(document, add_special=False, parse_special=False)
        out = [self.bos] if self.bos is not None else []
        out += q
        out += [t for t in (self.eos, self.sep) if t is not None]
        out += d
        return out + ([self.eos] if self.eos is not None else [])
