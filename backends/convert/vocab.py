"""Tokenizer block of a converted GGUF, built from a Hugging Face ``tokenizer.json`` (byte-level BPE).

llama.cpp's own converter names the pre-tokenizer by hashing the tokenization of a fixed string, so
any home-made tokenizer fails there; here the caller may name it (``--pre``) or it is read off the
structure of ``tokenizer.json``'s ``pre_tokenizer`` (docs/model-formats.md §1.5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from spekula.backends.convert.gguf_writer import GGUFOut
from spekula.backends.convert.source import load_json_object
from spekula.core.errors import ConfigError, ModelFileError

# Pre-tokenizer ids whose regexes llama.cpp (and our tokenizer) knows, for byte-level BPE vocabularies.
KNOWN_PRE = ("smollm", "qwen2", "llama-bpe", "qwen35", "gpt-2", "starcoder", "refact", "gpt-4o", "tekken")
# The start of o200k's (GPT-4o, gpt-oss) and tekken's (Mistral Nemo, Ministral 3) regexes: letter runs
# split by case.
_CASED_RUN = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"

# How llama.cpp's converter class for a vocabulary's architecture fills the tokenizer block: "llama"
# also copies tokenizer_config's add_prefix_space; "glm" gives the roles the tokenizer files leave
# unset GLM's chat tokens (and adds the end-of-turn / end-of-message ones); "gpt2" does neither.
VOCAB_FLAVOURS = ("gpt2", "llama", "glm")
_FLAVOUR_OF_ARCH = {"LlamaForCausalLM": "llama", "Glm4MoeForCausalLM": "glm"}
_GLM_ROLES = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}
_ROLE_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding", "eot": "eot", "eom": "eom"}

_NORMAL, _CONTROL, _USER, _UNUSED = (
    gguf.TokenType.NORMAL,
    gguf.TokenType.CONTROL,
    gguf.TokenType.USER_DEFINED,
    gguf.TokenType.UNUSED,
)


def infer_pre(tok: dict[str, Any], where: Path) -> str:
    """Name the llama.cpp pre-tokenizer equivalent to ``tokenizer.json``'s ``pre_tokenizer``."""
    pre = tok.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"]:
        pattern = parts[0].get("pattern") or {}
        regex = str(pattern.get("Regex", pattern.get("String", "")))
        cased = regex.startswith(_CASED_RUN)
        # o200k groups digits by three and keeps contractions with their word; tekken does neither
        if cased and r"\p{N}{1,3}" in regex and "(?i:'s|'t" in regex:
            return "gpt-4o"
        if cased and r"|\p{N}|" in regex and "'s" not in regex:
            return "tekken"
        if not cased and r"\p{N}{1,3}" in regex:
            return "llama-bpe"
        if not cased and r"[\p{L}\p{M}]+" in regex:
            return "qwen35"
        if not cased and r"\p{N}" in regex and ("(?i:'s|'t" in regex or "'[sS]" in regex):
            return "qwen2"
    raise ModelFileError(
        where / "tokenizer.json",
        f"cannot infer the pre-tokenizer from {kinds or 'no pre_tokenizer'}; name it with --pre "
        f"(one of {', '.join(KNOWN_PRE)})",
    )


def vocab_flavour(config: dict[str, Any]) -> str:
    """The flavour (see VOCAB_FLAVOURS) of the checkpoint whose config.json this is, as the owner of the vocabulary."""
    archs = config.get("architectures") or [""]
    return _FLAVOUR_OF_ARCH.get(str(archs[0]), "gpt2")


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def write_vocab(out: GGUFOut, src: Path, *, vocab_size: int | None, pre: str | None, flavour: str = "gpt2") -> int:
    """Write ``tokenizer.*`` keys from ``src`` (a checkpoint folder); returns the token count written.

    ``flavour`` (one of VOCAB_FLAVOURS) names the architecture whose converter llama.cpp would use for
    this vocabulary, which decides a few keys beyond the token list."""
    if flavour not in VOCAB_FLAVOURS:
        raise ValueError(f"unknown vocabulary flavour {flavour!r}")
    tok_path = src / "tokenizer.json"
    if not tok_path.is_file():
        raise ModelFileError(src, "no tokenizer.json (only byte-level BPE tokenizers are converted)")
    tok = load_json_object(tok_path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelFileError(tok_path, f"tokenizer model {model.get('type')!r} is not supported (need BPE)")
    if model.get("byte_fallback"):
        # Gemma 4's kind: llama.cpp writes it as tokenizer model "gemma4" with scores and its own types
        raise ModelFileError(tok_path, "SentencePiece-style BPE (byte_fallback, as Gemma 4's) is not converted; "
                                       "only byte-level BPE tokenizers are")
    if pre is None:
        pre = infer_pre(tok, src)
    elif pre not in KNOWN_PRE:
        raise ConfigError(f"unknown --pre {pre!r}; known: {', '.join(KNOWN_PRE)}")

    by_id: dict[int, tuple[str, gguf.TokenType]] = {int(i): (t, _NORMAL) for t, i in model["vocab"].items()}
    for added in tok.get("added_tokens") or []:
        text = str(added["content"])
        special = bool(added.get("special")) or (text.startswith("<|") and text.endswith("|>"))
        by_id[int(added["id"])] = (text, _CONTROL if special else _USER)
    n = max(max(by_id) + 1 if by_id else 0, int(vocab_size or 0))
    if vocab_size is not None and n > vocab_size:
        raise ModelFileError(tok_path, f"tokenizer has {n} tokens but config vocab_size is {vocab_size}")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        text, kind = by_id.get(i, (f"[PAD{i}]", _UNUSED))
        tokens.append(text)
        types.append(int(kind))

    merges = []
    for m in model.get("merges") or []:
        merges.append(" ".join(m) if isinstance(m, list) else str(m))

    w = out.w
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)

    index = {t: i for i, t in enumerate(tokens)}
    cfg_path = src / "tokenizer_config.json"
    tcfg = load_json_object(cfg_path) if cfg_path.is_file() else {}
    mcfg = load_json_object(src / "config.json") if (src / "config.json").is_file() else {}
    role_ids: dict[str, int] = {}
    for role in ("bos", "eos", "unk", "pad"):
        text = _token_text(tcfg.get(f"{role}_token"))
        tid = index.get(text) if text is not None else None
        if tid is None and isinstance(mcfg.get(f"{role}_token_id"), int):
            tid = int(mcfg[f"{role}_token_id"])
        if tid is not None and 0 <= tid < n:
            role_ids[role] = tid
    if flavour == "glm":
        added_ids = {str(a["content"]): int(a["id"]) for a in tok.get("added_tokens") or []}
        for role, text in _GLM_ROLES.items():
            if text not in added_ids:
                raise ModelFileError(tok_path, f"a GLM tokenizer needs the added token {text!r} (for {role})")
            role_ids.setdefault(role, added_ids[text])
    for role, tid in role_ids.items():
        w.add_uint32(f"tokenizer.ggml.{_ROLE_KEYS[role]}_token_id", tid)
    if flavour == "llama" and isinstance(tcfg.get("add_prefix_space"), bool):
        w.add_bool("tokenizer.ggml.add_space_prefix", tcfg["add_prefix_space"])
    for role, flag in _add_special_flags(tok, tcfg).items():
        w.add_bool(f"tokenizer.ggml.add_{role}_token", flag)
    template = tcfg.get("chat_template")
    jinja = src / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str):
        w.add_string("tokenizer.chat_template", template)
    return n


def _add_special_flags(tok: dict[str, Any], tcfg: dict[str, Any]) -> dict[str, bool]:
    """add_bos/add_eos as llama.cpp's SpecialVocab decides them: the post-processor first (ByteLevel
    means neither, a TemplateProcessing adds what it starts/ends with), then tokenizer_config's
    ``add_*_token``; a flag nothing determines is not written (the runtime default applies)."""
    flags: dict[str, bool] = {}
    post = tok.get("post_processor") or {}
    bos, eos = _token_text(tcfg.get("bos_token")), _token_text(tcfg.get("eos_token"))
    for proc in post.get("processors", [post]) if post else []:
        if proc.get("type") == "ByteLevel":
            flags.setdefault("bos", False)
            flags.setdefault("eos", False)
        elif proc.get("type") == "TemplateProcessing":
            single = proc.get("single") or []
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id") if isinstance(single[0], dict) else None
                last = single[-1].get("SpecialToken", {}).get("id") if isinstance(single[-1], dict) else None
                flags["bos"] = first is not None and first == bos
                flags["eos"] = last is not None and last == eos
    for role in ("bos", "eos"):
        value = tcfg.get(f"add_{role}_token")
        if isinstance(value, bool):
            flags.setdefault(role, value)
    return flags
