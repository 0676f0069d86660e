"""llama.cpp's WordPiece (WPM) tokenizer, the vocabulary model ``"bert"`` of BERT-style encoders.

A GGUF's BERT vocabulary is written in llama.cpp's "phantom space" form: a word-initial piece is
``▁piece``, a continuation piece (``##piece`` in the Hugging Face vocabulary) is ``piece``, control
tokens ([CLS], [SEP], ...) keep their text. Encoding a text fragment, as llm_tokenizer_wpm_session does:

1. Per code point: with accent stripping, map it to the first code point of its NFD decomposition
   (llama.cpp's one-to-one NFD table: ``é`` becomes ``e``); white space ends a word; NUL, U+FFFD and
   ``\\p{C}`` (except unassigned code points) are dropped, as are ``\\p{M}`` marks when stripping accents;
   lower-case it (the simple, one-code-point mapping) when the vocabulary asks; ``\\p{P}``, ASCII ``\\p{S}``
   and CJK ideographs are words of their own.
2. Per word, ``▁word`` is cut greedily from the left into the longest vocabulary pieces; a word with
   any part that matches nothing becomes the one unknown token (no length limit, unlike Hugging Face's
   100 characters).

Decoded text gets llama.cpp's ``clean_spaces`` passes (:func:`clean_spaces`).

Hugging Face's `tokenizers` WordPiece (BertNormalizer, BertPreTokenizer) gives llama.cpp's ids on all of
llama.cpp's bge test vectors, but not everywhere: its accent stripping keeps a full NFD decomposition, so a
Hangul syllable becomes its two or three jamo where llama.cpp keeps only the first ("한국어": llama-tokenize
gives [1469, 29991, 29999] on the bge vocabulary, `tokenizers` eight ids), and it drops only Mn marks where
llama.cpp drops every \\p{M}. So this module does what llama.cpp does.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping

PHANTOM_SPACE = "\u2581"
# llama.cpp's unicode_set_whitespace (Unicode's White_Space property)
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                         0x202F, 0x205F, 0x3000])
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))  # 0x2B920, as llama.cpp (and HF) have it


def _is_cjk(cpt: int) -> bool:
    return any(lo <= cpt <= hi for lo, hi in _CJK_RANGES)


def _lower(ch: str) -> str:
    """The simple (one code point) lower case, as llama.cpp's table holds it (U+0130 -> i)."""
    low = ch.lower()
    return low if len(low) == 1 else low[0]


def split_words(text: str, lowercase: bool, strip_accents: bool) -> list[str]:
    """The words of `text` after llama.cpp's WPM normalisation (step 1 of the module docstring)."""
    words: list[str] = []
    word: list[str] = []
    for ch in text:
        if strip_accents:
            ch = unicodedata.normalize("NFD", ch)[0]
        cpt = ord(ch)
        if cpt in _WHITESPACE:
            if word:
                words.append("".join(word))
                word = []
            continue
        category = unicodedata.category(ch)
        if cpt == 0 or cpt == 0xFFFD or (category[0] == "C" and category != "Cn"):
            continue
        if strip_accents and category[0] == "M":
            continue
        s = _lower(ch) if lowercase else ch
        if category[0] == "P" or (cpt < 0x7F and category[0] == "S") or _is_cjk(cpt):
            if word:
                words.append("".join(word))
                word = []
            words.append(s)
        else:
            word.append(s)
    if word:
        words.append("".join(word))
    return words


class WordPiece:
    """Greedy longest-match WordPiece over a phantom-space vocabulary (later duplicates win)."""

    def __init__(self, vocab: Mapping[str, int], unk_id: int, lowercase: bool, strip_accents: bool) -> None:
        self._vocab, self.unk_id = vocab, unk_id
        self.lowercase, self.strip_accents = lowercase, strip_accents
        self._max_len = max((len(t) for t in vocab), default=1)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for word in split_words(text, self.lowercase, self.strip_accents):
            out.extend(self._encode_word(PHANTOM_SPACE + word))
        return out

    def _encode_word(self, word: str) -> list[int]:
        pieces: list[int] = []
        i, n = 0, len(word)
        while i < n:
            for j in range(min(n, i + self._max_len), i, -1):
                tid = self._vocab.get(word[i:j])
                if tid is not None:
                    pieces.append(tid)
                    i = j
                    break
            else:
                return [self.unk_id]  # a part matches nothing: the whole word is unknown
        return pieces or [self.unk_id]


def clean_spaces(text: bytes) -> bytes:
    """llama.cpp's `clean_spaces` pass over a detokenized WordPiece text, in its three in-place passes: no
    space before ``?!.,``; `` ' `` loses both spaces; `` 's``, `` 'm``, `` 're``, `` 've`` lose theirs."""
    buf = bytearray(text)
    n = len(buf)
    total = 1 if n else 0
    for i in range(1, n):  # pass 1
        x = buf[i]
        if buf[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        buf[total] = x
        total += 1
    n, total, i = total, 1 if total else 0, 1
    while i < n:  # pass 2: the space after the apostrophe is skipped (and zeroed, as llama.cpp does)
        x = buf[i]
        if x == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            total -= 1
            i += 1
            buf[i] = 0
        buf[total] = x
        total += 1
        i += 1
    n, total = total, 1 if total else 0
    for i in range(1, n):  # pass 3
        x = buf[i]
        if buf[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = buf[i + 1]
            if x1 in b"sm" or (i + 2 < n and bytes((x1, buf[i + 2])) in (b"re", b"ve")):
                total -= 1
        buf[total] = x
        total += 1
    return bytes(buf[:total])
