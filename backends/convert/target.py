"""The target a draft is converted for: a Hugging Face folder or a GGUF file, behind one interface.

The draft converters (EAGLE-3, DFlash/DSpark) need two things from their target: a few facts in
Hugging Face config terms (``architectures``, ``vocab_size``, ``num_hidden_layers``, ``hidden_size``)
and the vocabulary block of the draft file. An HF folder has both in config.json and tokenizer.json.
A GGUF target (``--target-model``: one that exists only as a GGUF, such as the embedded SmolLM2) gives
the facts from its metadata and its tokenizer keys are copied as stored, value types included, so the
draft's vocabulary is the target's exactly; llama.cpp refuses a draft whose vocabulary differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import gguf

from spekula.backends.convert.gguf_writer import GGUFOut
from spekula.backends.convert.source import HFCheckpoint
from spekula.backends.convert.vocab import write_vocab
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

# GGUF architecture -> the HF class name its converter reads (what the draft converters check, e.g.
# DFlash refusing Gemma targets); other architectures keep their GGUF name.
_HF_ARCH_OF = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3moe": "Qwen3MoeForCausalLM", "glm4moe": "Glm4MoeForCausalLM", "qwen35": "Qwen3_5ForCausalLM",
               "qwen35moe": "Qwen3_5MoeForCausalLM", "gemma": "GemmaForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "gemma4": "Gemma4ForCausalLM"}
_DRAFT_ARCHS = ("eagle3", "dflash")
_MASK_KEY = "tokenizer.ggml.mask_token_id"


class TargetSource(Protocol):
    """What a draft converter reads from its target."""

    path: Path  # for messages: the folder or the file
    config: dict[str, Any]  # HF config fields (a GGUF target fills the ones the converters read)

    def write_vocab(self, out: GGUFOut, *, vocab_size: int, pre: str | None, flavour: str,
                    mask_token_id: int | None = None) -> None:
        """Write the draft's ``tokenizer.*`` block: the target's vocabulary, with the draft's own mask
        token (DFlash) in place of any the target names. ``pre`` and ``flavour`` say how to convert a
        tokenizer.json (see convert_vocab.write_vocab)."""
        ...


@dataclass
class HFTarget:
    """A target given as its Hugging Face folder (``--target-model-dir``)."""

    ckpt: HFCheckpoint

    @property
    def path(self) -> Path:
        return self.ckpt.path

    @property
    def config(self) -> dict[str, Any]:
        return self.ckpt.config

    def write_vocab(self, out: GGUFOut, *, vocab_size: int, pre: str | None, flavour: str,
                    mask_token_id: int | None = None) -> None:
        write_vocab(out, self.path, vocab_size=vocab_size, pre=pre, flavour=flavour)
        if mask_token_id is not None:
            out.w.add_uint32(_MASK_KEY, mask_token_id)


@dataclass
class GGUFTarget:
    """A target given as a GGUF file (``--target-model``)."""

    file: GGUFFile
    config: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.file.path

    @classmethod
    def open(cls, path: str | Path) -> GGUFTarget:
        f = GGUFFile(path)
        arch = f.architecture
        if arch in _DRAFT_ARCHS:
            raise ModelFileError(f.path, f"is an {arch} draft, not a target model (--target-model wants the "
                                 "decoder the draft runs beside)")
        kind = f.get("general.type", "model")
        if kind != "model":
            raise ModelFileError(f.path, f"general.type is {kind!r}, not a target model")
        n_block = _int_key(f, f"{arch}.block_count")
        n_layer = n_block - int(f.get(f"{arch}.nextn_predict_layers", 0) or 0)
        if n_layer <= 0 or not f.has_tensor("blk.0.attn_norm.weight"):
            raise ModelFileError(f.path, "has no decoder blocks (blk.0.*): not a target model")
        tokens = f.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, Sequence) or isinstance(tokens, str) or not tokens:
            raise ModelFileError(f.path, "has no vocabulary (tokenizer.ggml.tokens): not a target model")
        if not f.has_tensor("token_embd.weight"):
            raise ModelFileError(f.path, "missing tensor 'token_embd.weight': not a target model")
        hidden = _int_key(f, f"{arch}.embedding_length")
        rows, width = f.tensor("token_embd.weight").shape
        if (rows, width) != (len(tokens), hidden):
            raise ModelFileError(f.path, f"token_embd.weight is [{rows}, {width}] but the file has {len(tokens)} "
                                 f"tokens and embedding_length {hidden}")
        config = {"architectures": [_HF_ARCH_OF.get(arch, arch)], "vocab_size": len(tokens),
                  "num_hidden_layers": n_layer, "hidden_size": hidden}
        return cls(f, config)

    def write_vocab(self, out: GGUFOut, *, vocab_size: int, pre: str | None, flavour: str,
                    mask_token_id: int | None = None) -> None:
        # vocab_size and flavour decide how a tokenizer.json becomes keys; here the keys already exist
        # (and open() checked the token count against the embeddings).
        if pre is not None:
            raise ConfigError(f"--pre names the pre-tokenizer of a tokenizer.json; the vocabulary of "
                              f"--target-model {self.path} is copied as stored")
        for key, value in self.file.metadata.items():
            if not key.startswith("tokenizer.") or (key == _MASK_KEY and mask_token_id is not None):
                continue
            vtype, etype = self.file.value_type(key)
            sub = gguf.GGUFValueType(etype) if etype is not None else None
            out.w.add_key_value(key, value, gguf.GGUFValueType(vtype), sub_type=sub)
        if mask_token_id is not None:
            out.w.add_uint32(_MASK_KEY, mask_token_id)


def _int_key(f: GGUFFile, key: str) -> int:
    value = f.require(key)
    if isinstance(value, list):  # per-layer arrays: a draft only needs the one value all layers share
        if not value or any(v != value[0] for v in value):
            raise ModelFileError(f.path, f"per-layer varying {key!r} is not supported")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelFileError(f.path, f"metadata {key!r} is not an integer: {value!r}")
    return value


def open_target(target_dir: str | Path | None, target_gguf: str | Path | None, draft_name: str) -> TargetSource:
    """The target of a draft conversion: exactly one of its HF folder and its GGUF file."""
    if target_dir is not None and target_gguf is not None:
        raise ConfigError("--target-model-dir and --target-model both name the target; give one")
    if target_gguf is not None:
        return GGUFTarget.open(target_gguf)
    if target_dir is not None:
        return HFTarget(HFCheckpoint.open(target_dir))
    raise ConfigError(f"{draft_name} draft needs --target-model-dir (the target's HF folder: tokenizer and "
                      "config) or --target-model (the target's GGUF file)")
