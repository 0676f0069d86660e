"""Small byte-level BPE vocabularies for tokenizer tests: token 0 a control token, 1..256 the 256 byte
symbols, then one token per merge in the given order, then whole words that no merge produces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spekula.core.modelfile.tokenizer import CONTROL, NORMAL, bytes_to_unicode

BYTE_CHAR = bytes_to_unicode()


def byte_level(text: str) -> str:
    """`text` as the byte symbols a byte-level vocabulary spells it with."""
    return "".join(BYTE_CHAR[b] for b in text.encode("utf-8"))


def byte_level_vocab(pre: str, merges: Sequence[tuple[str, str]], words: Sequence[str] = (),
                     **extra: Any) -> dict[str, Any]:
    """GGUF tokenizer metadata of such a vocabulary under pre-tokenizer `pre`; `extra` adds or overrides keys
    (after the ``tokenizer.ggml.`` prefix)."""
    tokens = ["<|endoftext|>", *(BYTE_CHAR[b] for b in range(256)), *(a + b for a, b in merges), *words]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL] + [NORMAL] * (len(tokens) - 1),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    return meta | {f"tokenizer.ggml.{k}": v for k, v in extra.items()}
