"""The pre-tokenizers of byte-level BPE vocabularies, by the ``tokenizer.ggml.pre`` names llama.cpp reads.

Each name maps to the split llama.cpp's llama-vocab.cpp applies before BPE: GPT-2's regex, every digit
isolated and then GPT-2's regex (starcoder's list), or llama.cpp's own regexes applied one after the
other, each isolating its matches. The regexes are llama.cpp's rewrites (case-insensitive groups spelled
out, ``[\\p{Lu}...]`` classes as ``(?=[\\p{L}])[^a-z]`` lookaheads), not the originals of tokenizer.json:
their meaning differs on non-ASCII letters, and llama.cpp's is the one a GGUF is tokenized with.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "not ASCII lowercase / uppercase" letter runs: llama.cpp's form of o200k's and tekken's case classes
_UPPER_RUN = r"((?=[\p{L}])([^a-z]))"
_LOWER_RUN = r"((?=[\p{L}])([^A-Z]))"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}*{_LOWER_RUN}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}+{_LOWER_RUN}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}*{_LOWER_RUN}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}+{_LOWER_RUN}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GPT-2's regex as llama.cpp spells it for the multi-regex lists below
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_FALCON_SPLITS = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, "[0-9][0-9][0-9]")
_CJK_RUN = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_CODER_SPLITS = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RUN, r"\p{N}")
# deepseek-llm's letters: an explicit list of cased-letter ranges (llama.cpp's, from the tokenizer.json)
_DEEPSEEK_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-"
    "ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-"
    "ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_DEEPSEEK_LLM_SPLITS = (
    "[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+", "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$", _CJK_RUN, r"\p{N}+",
)

# pre name -> (splits, ignore_merges). "gpt2": GPT-2's regex; "digits": every digit isolated first, then
# GPT-2's regex (llama.cpp's starcoder/smollm/command-r list); otherwise regexes applied in turn.
PRE_TYPES: dict[str, tuple[str | tuple[str, ...], bool]] = {
    "gpt2": ("gpt2", False),
    "gpt-2": ("gpt2", False),
    "mpt": ("gpt2", False),
    "smollm": ("digits", False),
    "starcoder": ("digits", False),
    "refact": ("digits", False),
    "command-r": ("digits", False),
    "falcon": (_FALCON_SPLITS, False),
    "deepseek-coder": (_DEEPSEEK_CODER_SPLITS, False),
    "deepseek-llm": (_DEEPSEEK_LLM_SPLITS, False),
    "qwen2": ((_QWEN2_SPLIT,), False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), False),
    "qwen35": ((_QWEN35_SPLIT,), False),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "llama3": ((_LLAMA3_SPLIT,), True),
    "llama-v3": ((_LLAMA3_SPLIT,), True),
    "gpt-4o": ((_GPT4O_SPLIT,), False),
    "tekken": ((_TEKKEN_SPLIT,), True),
}
# llama.cpp adds BOS by default for these pre-tokenizers when the file does not say
PRE_ADD_BOS = frozenset({"llama-bpe", "llama3", "llama-v3", "tekken"})


def byte_level_pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer ending in ByteLevel, ignore_merges) for a ``tokenizer.ggml.pre`` name.

    Raises KeyError for names this module does not implement (callers turn that into a clear error).
    """
    kind, ignore_merges = PRE_TYPES[pre]
    if kind == "gpt2":
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif kind == "digits":
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        splits: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in kind
        ]
        pre_tok = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return pre_tok, ignore_merges


def supported_pre_tokenizers() -> list[str]:
    return sorted(PRE_TYPES)
