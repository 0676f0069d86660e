"""The model's tokenizer, rebuilt from GGUF metadata with llama.cpp's semantics.

Four vocabulary kinds are supported:
* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE with a pre-tokenizer named by ``tokenizer.ggml.pre``
  (pretokenizers.py lists them: GPT-2's, starcoder's, qwen2's, llama3's, o200k's ``gpt-4o``, ``tekken``...);
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE driven by token scores, ``▁`` for spaces,
  ``<0xNN>`` byte fallback tokens and a space prefix (Llama 2, Gemma 3, Mistral's older vocabularies);
* ``tokenizer.ggml.model == "gemma4"``: BPE ranked by its merge list over UTF-8 characters, ``▁`` for
  spaces, no space prefix, ``<0xNN>`` byte fallback, words split only at newlines.
* ``tokenizer.ggml.model == "bert"``: llama.cpp's WordPiece (wordpiece.py), ``[CLS]`` and ``[SEP]`` around
  every encoded text; decoding joins ``▁`` pieces with spaces and cleans spaces as llama.cpp does.

Special tokens are split out of the text first, the way llama.cpp does it (longest special first,
control tokens only when ``parse_special``, user-defined tokens always); each plain-text fragment is then
encoded by a `tokenizers` BPE model (WordPiece: wordpiece.py) that knows nothing about specials. (Over 400 lines: the four
vocabulary kinds are derived, cached and encoded through the same private tables.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from spekula.core.errors import ModelFileError
from spekula.core.modelfile import file_cache, gguf_file, merge_pairs, pretokenizers, token_pieces
from spekula.core.modelfile.gguf_arrays import StringArray
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.merge_pairs import MergePairs
from spekula.core.modelfile.pretokenizers import (
    PRE_ADD_BOS,
    PRE_TYPES,
    byte_level_pre_tokenizer,
    supported_pre_tokenizers,
)
from spekula.core.modelfile.stream_decode import StreamDecoder
from spekula.core.modelfile.token_pieces import PieceTable
from spekula.core.modelfile.wordpiece import WordPiece, clean_spaces

# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_GIL_FREE_CHARS = 4096
_NEWLINE_RUNS = re.compile(r"[^\n]+|\n+")
# Vocabularies at least this large keep what is derived from them in the header cache (file_cache.py).
CACHE_MIN_VOCAB = 4096

# Token texts llama.cpp treats as end-of-generation whatever their declared type (llama-vocab.cpp).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    }
)  # fmt: skip
# Fill-in-the-middle tokens, found by text (as llama.cpp finds them) when their id keys are absent.
_FIM_TEXTS = (
    ("fim_pre", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>",
                 "<|code_prefix|>", "<|prefix|>")),
    ("fim_suf", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>",
                 "<|code_suffix|>", "<|suffix|>")),
    ("fim_mid", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>",
                 "<|code_middle|>", "<|middle|>")),
    ("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    ("fim_rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    ("fim_sep", ("<|file_sep|>",)),
)
_FIM_EOG = ("fim_pad", "fim_rep", "fim_sep")  # these also end the generation


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}
# str.translate table taking each byte-alphabet character to the Latin-1 character of its byte, and each
# other character below U+0100 to its UTF-8 bytes as Latin-1 characters: a piece then encodes to Latin-1
# in one C call, and only a piece with a character from U+0100 up outside the alphabet fails and takes
# the per-character path.
_LATIN1_OF_CHAR = {**{i: chr(i).encode("utf-8").decode("latin-1") for i in range(256)},
                   **{ord(c): chr(b) for c, b in _BYTE_OF_CHAR.items()}}


def _code_digest() -> str:
    """What a tokenizer cache entry depends on besides the file: this module, the header reader and the
    piece table's and merge ids' layouts."""
    modules = (gguf_file, pretokenizers, token_pieces, merge_pairs)
    return "".join(file_cache.source_digest(m.__file__) for m in modules) + file_cache.source_digest(__file__)


@dataclass(frozen=True, slots=True)
class _Special:
    token: int
    text: str
    always: bool  # user-defined tokens are split out even when parse_special is off


# bytes.translate table: 1 for the token types decode(skip_special=True) leaves out, 0 for the rest
_SKIPPED_TYPES = bytes(int(t in (CONTROL, UNKNOWN)) for t in range(256))


def _type_bytes(types: Sequence[Any]) -> bytearray:
    """Token types one byte each (a list of 262k ints is 2 MB). A value outside 0-255 is no type llama.cpp
    defines: it is read as 0 (undefined), which, like any type not known here, renders as nothing."""
    try:
        return bytearray(map(int, types))
    except ValueError:
        return bytearray(t if 0 <= t < 256 else 0 for t in map(int, types))


class Tokenizer:
    """Encode/decode with the vocabulary of one GGUF model (see module docstring)."""

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    eog_ids: frozenset[int]
    fim: dict[str, int]  # fill-in-the-middle tokens by role: fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep
    chat_template: str | None
    chat_template_kwargs: dict[str, Any]  # extra template variables every render gets (--chat-template-kwargs)

    def __init__(self, meta: dict[str, Any], *, source: object = "<metadata>",
                 cache_identity: file_cache.Identity | None = None) -> None:
        """`cache_identity`: the identity (file_cache.file_identity) of the file `meta` was read from, to
        take what is derived from the vocabulary from the header cache, or leave it there."""
        self._source = source
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            missing = "tokenizer.ggml.model" if model is None else "tokenizer.ggml.tokens"
            raise ModelFileError(source, f"no tokenizer in this file (missing metadata key {missing!r})")
        # Construction reads every text several times, from a list; afterwards a large vocabulary stays
        # the metadata's bytes (gguf_arrays.StringArray, a text decoded when read), so the 262k strings
        # made here are freed once the encoder is built (see the end of __init__).
        kept: Sequence[str] | None = tokens if isinstance(tokens, StringArray) else None
        self._tokens: Sequence[str] = kept.to_list() if kept is not None else list(map(str, tokens))
        self.n_vocab = len(self._tokens)
        if self.n_vocab == 0:
            raise ModelFileError(source, "tokenizer.ggml.tokens is empty")
        types = meta.get("tokenizer.ggml.token_type")
        self._types = _type_bytes(types) if types is not None else bytearray([NORMAL]) * self.n_vocab
        if len(self._types) != self.n_vocab:
            raise ModelFileError(
                source, f"token_type has {len(self._types)} entries for {self.n_vocab} tokens"
            )
        self.model_kind = str(model)
        self.pre = str(meta.get("tokenizer.ggml.pre") or "")
        if self.model_kind == "gpt2":
            default_bos = default_eos = 11
            default_add_bos = self.pre in PRE_ADD_BOS
        elif self.model_kind == "llama":
            default_bos, default_eos = 1, 2
            default_add_bos = True
        elif self.model_kind == "gemma4":
            default_bos = default_eos = None
            default_add_bos = True
            self.pre = "gemma4"  # llama.cpp sets it whatever the file says
        elif self.model_kind == "bert":
            default_bos, default_eos = 101, None  # [CLS]; llama.cpp's WPM defaults
            default_add_bos = True
        else:
            raise ModelFileError(
                source, f"unsupported tokenizer model {self.model_kind!r} (supported: 'gpt2', 'llama', 'gemma4', 'bert')"
            )
        self.bos_id = self._special_id(meta, "bos", default_bos)
        self.eos_id = self._special_id(meta, "eos", default_eos)
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
        if self.model_kind == "gemma4":
            self.add_bos = True  # llama.cpp overrides a false add_bos_token for Gemma 4
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        # what closes an encoded text when add_eos: EOS, or for WordPiece [SEP] always (llama.cpp's add_sep)
        self._end_id = self.eos_id
        if self.model_kind == "bert":
            self.add_bos = self.add_eos = True  # llama.cpp adds [CLS] and [SEP] whatever the file says
            self._end_id = self._special_id(meta, "seperator", 102)
        self.chat_template = meta.get("tokenizer.chat_template")
        self.chat_template_kwargs = {}
        has_bytes = BYTE in self._types  # as declared, before the type fixes below
        vocab = {t: i for i, t in enumerate(self._tokens)}  # later duplicates win, as in llama.cpp
        merges = self._restore(file_cache.load("tokenizer", cache_identity, _code_digest()))
        if merges is None:
            merges = self._derive(meta, vocab)
            if self.n_vocab >= CACHE_MIN_VOCAB:
                file_cache.store("tokenizer", cache_identity, _code_digest(), self._derived(merges, vocab))
        self._skip = bytes(self._types.translate(_SKIPPED_TYPES))
        if kept is not None:  # the list goes before the encoder's own copy of the vocabulary is made
            self._tokens = kept
        if self.model_kind == "gpt2":
            self._init_bpe(vocab, merges)
        elif self.model_kind == "gemma4":
            self._init_spaced_bpe(vocab, merges)
        elif self.model_kind == "bert":
            self._init_wordpiece(meta, vocab)
        else:
            self._init_spm(meta, vocab, merges, has_bytes)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Tokenizer:
        return cls(f.metadata, source=f.path, cache_identity=file_cache.file_identity(f.path))

    # ---- construction helpers -------------------------------------------------------------------

    def _derive(self, meta: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
        """Everything built by walking the vocabulary (the header cache keeps it, see `_derived`): the
        BPE merges, the special-token fixes to the types, fim, eog, the specials and the pieces."""
        if self.model_kind == "llama":
            merges = self._spm_merges(meta, vocab)
        elif self.model_kind == "bert":
            merges = []  # WordPiece has no merges
        else:
            if self.model_kind == "gpt2":
                self._checked_pre()  # an unsupported pre-tokenizer fails before any work
            merges = self._bpe_merges(meta, vocab)
        self.fim = self._find_fim(meta, vocab)
        self.eog_ids = self._build_eog(meta, vocab)
        self._specials = self._build_specials()
        self._pieces = PieceTable.from_pieces(self._piece(i) for i in range(self.n_vocab))
        return merges

    def _derived(self, merges: list[tuple[str, str]], vocab: dict[str, int]) -> tuple[Any, ...]:
        # Merges as the token ids of their two parts (both are tokens), two id buffers (merge_pairs.py): read
        # back without a Python object per merge.
        merge_ids = MergePairs.from_texts(self._tokens, merges, vocab).to_cache()
        specials = [(s.token, s.text, s.always) for s in self._specials]
        return merge_ids, bytes(self._types), self.fim, sorted(self.eog_ids), specials, self._pieces.to_cache()

    def _restore(self, cached: Any) -> Sequence[tuple[str, str]] | None:
        """The merges of a header-cache entry (`_derived`), its other parts set on self; None if it is not one."""
        try:
            merge_ids, types, fim, eog, specials, (blob, offsets) = cached
            pieces = PieceTable.from_cache(blob, offsets)
            if len(types) != self.n_vocab or len(pieces) != self.n_vocab:
                return None
            merges = MergePairs.from_cache(self._tokens, *merge_ids)
            restored = [_Special(token, text, always) for token, text, always in specials]
        except (TypeError, ValueError, IndexError):
            return None
        self._types, self.fim, self.eog_ids = bytearray(types), dict(fim), frozenset(eog)
        self._specials, self._pieces = restored, pieces
        return merges

    def _bpe_merges(self, meta: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
        raw_merges = meta.get("tokenizer.ggml.merges")
        if raw_merges is None:
            raise ModelFileError(
                self._source, "missing metadata key 'tokenizer.ggml.merges' (needed by BPE)"
            )
        merges: list[tuple[str, str]] = []
        for m in raw_merges:
            cut = str(m).find(" ", 1)  # a part may itself start with a space: split at the first one after it
            if cut < 0:
                continue
            a, b = m[:cut], m[cut + 1 :]
            if a in vocab and b in vocab and a + b in vocab:
                merges.append((a, b))
        return merges

    def _checked_pre(self) -> str:
        pre = self.pre or "gpt2"  # llama.cpp falls back to its default regex (with a warning) when absent
        if pre not in PRE_TYPES:
            raise ModelFileError(
                self._source,
                f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(supported_pre_tokenizers())})",
            )
        return pre

    def _init_bpe(self, vocab: dict[str, int], merges: Sequence[tuple[str, str]]) -> None:
        pre_tok, ignore_merges = byte_level_pre_tokenizer(self._checked_pre())
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False)
        self._core = HFTokenizer(bpe)
        self._core.pre_tokenizer = pre_tok
        self._core.decoder = decoders.ByteLevel()
        self._add_space_prefix = False

    def _init_spaced_bpe(self, vocab: dict[str, int], merges: Sequence[tuple[str, str]]) -> None:
        """Gemma 4: BPE ranked by the merge list over raw UTF-8 characters, spaces written as ``▁``, no
        word split but at newlines, ``<0xNN>`` tokens for characters the vocabulary lacks."""
        self._core = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=True))
        # A newline run is looked up in the encoder's own vocabulary (the same text -> id map): keeping
        # the Python dict for it held ~36 MB of strings and ints for a 262k vocabulary.
        self._token_id = self._core.token_to_id
        self._add_space_prefix = False

    def _init_wordpiece(self, meta: dict[str, Any], vocab: dict[str, int]) -> None:
        """llama.cpp's WPM (wordpiece.py): lower-casing from the file, accent stripping with it unless the
        file says otherwise."""
        lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
        strip_accents = bool(meta.get("tokenizer.ggml.normalizer.strip_accents", lowercase))
        unk = self._special_id(meta, "unknown", 100)
        self._wordpiece = WordPiece(vocab, unk if unk is not None else 0, lowercase, strip_accents)
        self._add_space_prefix = False

    def _spm_merges(self, meta: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != self.n_vocab:
            raise ModelFileError(
                self._source, "SentencePiece vocabulary needs tokenizer.ggml.scores (one per token)"
            )
        # llama.cpp merges the adjacent pair whose joined text is the best-scored token; a BPE merge list
        # ranked by that score gives the same result.
        ranked: list[tuple[float, int, str, str]] = []
        for tid, text in enumerate(self._tokens):
            if self._types[tid] != NORMAL or len(text) < 2:
                continue
            for cut in range(1, len(text)):
                a, b = text[:cut], text[cut:]
                if a in vocab and b in vocab:
                    ranked.append((-float(scores[tid]), tid, a, b))
        ranked.sort()
        return [(a, b) for _, _, a, b in ranked]

    def _init_spm(self, meta: dict[str, Any], vocab: dict[str, int], merges: Sequence[tuple[str, str]],
                  has_bytes: bool) -> None:
        unk = self._special_id(meta, "unknown", 0)
        bpe = models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=self._tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=has_bytes,
        )
        self._core = HFTokenizer(bpe)
        self._add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))

    def _special_id(self, meta: dict[str, Any], name: str, default: int | None) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is None:
            return default if default is not None and default < self.n_vocab else None
        value = int(value)
        return value if 0 <= value < self.n_vocab else default

    def _find_fim(self, meta: dict[str, Any], by_text: dict[str, int]) -> dict[str, int]:
        """The fill-in-the-middle tokens this vocabulary has ("fim_pre", "fim_suf", "fim_mid", ...)."""
        out: dict[str, int] = {}
        for name, texts in _FIM_TEXTS:
            tid = self._special_id(meta, name, None)
            if tid is None:
                tid = next((by_text[t] for t in texts if t in by_text), None)
                if tid is not None:
                    self._types[tid] = CONTROL  # found by text: llama.cpp makes it a control token
            if tid is not None:
                out[name] = tid
        return out

    def _build_eog(self, meta: dict[str, Any], by_text: dict[str, int]) -> frozenset[int]:
        eog: set[int] = {self.fim[name] for name in _FIM_EOG if name in self.fim}
        for text, tid in by_text.items():
            if text in _EOG_TEXTS:
                eog.add(tid)
                self._types[tid] = CONTROL  # llama.cpp overrides a mislabelled type the same way
        for name in ("eos", "eot", "eom"):
            tid = self.eos_id if name == "eos" else self._special_id(meta, name, None)
            if tid is not None:
                eog.add(tid)
        texts = {self._tokens[i]: i for i in eog}
        # gpt-oss / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in texts and "<|call|>" in texts and ("<|return|>" in texts or "<|flush|>" in texts):
            eog.discard(texts["<|end|>"])
            self._types[texts["<|end|>"]] = USER_DEFINED
        # gemma4 / plamo: "</s>" is ordinary text there
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            self._types[texts["</s>"]] = NORMAL
        return frozenset(eog)

    def _build_specials(self) -> list[_Special]:
        out = [
            _Special(i, text, self._types[i] == USER_DEFINED)
            for i, text in enumerate(self._tokens)
            if self._types[i] in (CONTROL, USER_DEFINED, UNKNOWN) and text
        ]
        out.sort(key=lambda s: (-len(s.text.encode("utf-8")), s.token))
        return out

    def _piece(self, tid: int) -> bytes:
        """The bytes token `tid` stands for (control tokens: their text)."""
        text, kind = self._tokens[tid], self._types[tid]
        if kind in (CONTROL, USER_DEFINED, UNKNOWN):
            return text.encode("utf-8")
        if kind == BYTE:
            if self.model_kind in ("llama", "gemma4", "bert") and text.startswith("<0x") and text.endswith(">"):
                return bytes([int(text[3:-1], 16)])
            return bytes([_BYTE_OF_CHAR[text]]) if text in _BYTE_OF_CHAR else text.encode("utf-8")
        if kind != NORMAL:
            return b""  # UNUSED and undefined tokens render as nothing in llama.cpp
        if self.model_kind in ("llama", "gemma4", "bert"):
            return text.replace("\u2581", " ").encode("utf-8")
        # characters outside the byte alphabet (hand-added tokens) stand for their own UTF-8
        try:
            return text.translate(_LATIN1_OF_CHAR).encode("latin-1")
        except UnicodeEncodeError:
            return b"".join(bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode("utf-8") for c in text)

    # ---- public API ----------------------------------------------------------------------------

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def token_text(self, token: int) -> str:
        return self._tokens[token]

    def token_type(self, token: int) -> int:
        return self._types[token]

    def token_bytes(self, token: int) -> bytes:
        """What the token contributes to decoded output (control tokens included)."""
        return self._pieces[token]

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        parts: list[str | int] = [text] if text else []
        for sp in self._specials:
            if not (parse_special or sp.always):
                continue
            nxt: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or sp.text not in part:
                    nxt.append(part)
                    continue
                chunks = part.split(sp.text)
                for k, chunk in enumerate(chunks):
                    if k:
                        nxt.append(sp.token)
                    if chunk:
                        nxt.append(chunk)
            parts = nxt
        return parts

    def _encode_spaced(self, fragment: str) -> list[int]:
        """Gemma 4's fragment: lines and newline runs apart, a newline run that is a token taken whole
        (llama.cpp merges nothing inside it), spaces as ``▁``."""
        out: list[int] = []
        for run in _NEWLINE_RUNS.findall(fragment.replace(" ", "\u2581")):
            tid = self._token_id(run) if run[0] == "\n" else None
            out.extend([tid] if tid is not None else self._encode_core(run))
        return out

    def _encode_core(self, text: str) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            # The batch call releases the GIL while it works, so a long text does not stall the
            # event loop of a server tokenizing it in a worker thread.
            return self._core.encode_batch([text], add_special_tokens=False)[0].ids
        return self._core.encode(text, add_special_tokens=False).ids

    def _encode_fragment(self, fragment: str, prev_special: bool) -> list[int]:
        if self.model_kind == "gemma4":
            return self._encode_spaced(fragment)
        if self.model_kind == "bert":
            return self._wordpiece.encode(fragment)
        if self.model_kind == "llama":
            if self._add_space_prefix and prev_special:
                fragment = " " + fragment
            fragment = fragment.replace(" ", "\u2581")
        return self._encode_core(fragment)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text -> ids. `add_special`: BOS/EOS as the model asks; `parse_special`: recognise control tokens."""
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        prev_special = True  # SentencePiece prefixes a space to the first fragment and after specials
        for part in self._partition(text, parse_special):
            if isinstance(part, int):
                out.append(part)
                prev_special = True
            else:
                out.extend(self._encode_fragment(part, prev_special))
                prev_special = False
        if add_special and self.add_eos and self._end_id is not None:
            out.append(self._end_id)
        return out

    def _check_ids(self, ids: Sequence[int]) -> None:
        for t in ids:
            if not 0 <= int(t) < self.n_vocab:
                raise ValueError(f"token id {t} out of range [0, {self.n_vocab})")

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Ids -> text; with SentencePiece the space prefix that encode() added is removed again."""
        self._check_ids(ids)
        ids = [int(t) for t in ids]
        skip = self._skip if skip_special else None
        text = self._pieces.concat(ids, skip)
        # llama.cpp strips one leading space from the first token only, and never after a BOS
        if (self._add_space_prefix and ids and ids[0] != self.bos_id and not (skip and skip[ids[0]])
                and text.startswith(b" ")):
            text = text[1:]
        if self.model_kind == "bert":
            text = clean_spaces(text)  # llama.cpp's detokenize does it for WordPiece vocabularies
        return text.decode("utf-8", errors="replace")

    def stream_decoder(self, *, skip_special: bool = False) -> StreamDecoder:
        """Incremental decoder for generated tokens (no space-prefix removal, like llama.cpp's pieces)."""

        def piece(t: int) -> bytes:
            if not 0 <= t < self.n_vocab:
                raise ValueError(f"token id {t} out of range [0, {self.n_vocab})")
            return b"" if skip_special and self._skip[t] else self._pieces[t]

        return StreamDecoder(piece)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """`extra` reaches the template as variables (e.g. `tools`, for templates that render them), over
        the defaults in `chat_template_kwargs`."""
        from spekula.core.modelfile.chat_template import render_chat

        bos = self._tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self._tokens[self.eos_id] if self.eos_id is not None else ""
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            **{**self.chat_template_kwargs, **extra},
        )
