"""What a GGUF BERT-style encoder is: the `bert` architecture, read once into one description.

The decoders' recipes (gguf/architecture.py) describe causal blocks with rope and a KV cache; an encoder
has none of those, so its description lives here and every backend that runs encoders builds its forward
from :class:`EncoderHParams` alone. The graph, as llama.cpp's ``llama_model_bert`` builds it:

* input: ``token_embd[t] + token_types[0] + position_embd[p]`` (token type 0, "sentence A", for every
  token; learned absolute positions, so a sequence holds at most ``context_length`` tokens), then
  LayerNorm with bias (``token_embd_norm``);
* each block, post-norm: ``x = LN_attn_out(x + attn_output(attn(q, k, v)))`` with biased q/k/v/o
  projections and attention over every token of the sequence (non-causal, scale 1/sqrt(head_dim));
  then ``x = LN_layer_out(x + ffn_down(gelu(ffn_up(x))))`` with biases (GELU in ggml's tanh form);
* output: the last block's hidden states, pooled by the file's ``bert.pooling_type`` (CLS for BGE; read
  where the server's pooling is chosen, frontends/cli/embedding_options.py).

LayerNorm epsilon is ``attention.layer_norm_epsilon``. A file with what this graph does not run (attention
q/k norms, a fused qkv, a gated FFN, MoE blocks: llama.cpp's other BERT variants) is refused by name; so are
the other encoder architectures llama.cpp knows (:data:`OTHER_ENCODER_ARCHS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

ENCODER_ARCHS = ("bert",)
# llama.cpp's other encoder-only embedding architectures, which spekula does not build
OTHER_ENCODER_ARCHS = ("nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert", "neo-bert",
                       "eurobert", "t5encoder")
# Per-block tensors the graph needs (weight and bias each)
BLOCK_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_output_norm", "ffn_up", "ffn_down",
                 "layer_output_norm")
# Tensors of llama.cpp's BERT variants that this graph does not run
_UNSUPPORTED_BLOCK_TENSORS = {"attn_qkv": "a fused qkv projection", "attn_q_norm": "attention q/k norms",
                              "ffn_gate": "a gated FFN", "ffn_gate_inp": "mixture-of-experts blocks",
                              "attn_norm_2": "a second attention norm"}


def is_encoder(f: GGUFFile) -> bool:
    """Whether `f` is an encoder-only model (one spekula builds, or one it refuses by name)."""
    return f.architecture in ENCODER_ARCHS + OTHER_ENCODER_ARCHS


@dataclass(frozen=True)
class EncoderHParams:
    """One BERT-style file's hyper-parameters."""

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    n_positions: int  # rows of position_embd (context_length): the longest sequence it encodes
    n_token_types: int  # rows of token_types (0: the file has none)
    norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def read_encoder_hparams(f: GGUFFile) -> EncoderHParams:
    """`f`'s encoder description; anything missing, malformed or unsupported is one ModelFileError."""
    arch = f.architecture
    if arch in OTHER_ENCODER_ARCHS:
        raise ModelFileError(f.path, f"encoder architecture {arch!r} is not supported (supported encoders: "
                                     f"{', '.join(ENCODER_ARCHS)})")
    if arch not in ENCODER_ARCHS:
        raise ModelFileError(f.path, f"{arch!r} is not an encoder architecture ({', '.join(ENCODER_ARCHS)})")

    def key(name: str, default: Any = None) -> int:
        value = f.require(f"{arch}.{name}") if default is None else f.get(f"{arch}.{name}", default)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ModelFileError(f.path, f"metadata {arch}.{name} is not an integer: {value!r}") from None

    n_embd, n_head, n_layer, n_ff = (key("embedding_length"), key("attention.head_count"), key("block_count"),
                                     key("feed_forward_length"))
    if n_head <= 0 or n_embd % n_head or n_layer <= 0 or n_ff <= 0:
        raise ModelFileError(f.path, f"invalid encoder sizes: n_embd={n_embd} n_head={n_head} n_layer={n_layer} "
                                     f"n_ff={n_ff}")
    if key("attention.head_count_kv", n_head) != n_head:
        raise ModelFileError(f.path, "grouped key/value heads are not supported in a bert encoder")
    for name in ("token_embd.weight", "position_embd.weight", "token_embd_norm.weight", "token_embd_norm.bias"):
        if not f.has_tensor(name):
            raise ModelFileError(f.path, f"missing tensor {name!r}")
    for i in range(n_layer):
        for stem, what in _UNSUPPORTED_BLOCK_TENSORS.items():
            if f.has_tensor(f"blk.{i}.{stem}.weight"):
                raise ModelFileError(f.path, f"this bert file has {what} (blk.{i}.{stem}), which spekula does not run")
        for stem in BLOCK_TENSORS:
            for part in ("weight", "bias"):
                if not f.has_tensor(f"blk.{i}.{stem}.{part}"):
                    raise ModelFileError(f.path, f"missing tensor 'blk.{i}.{stem}.{part}'")
    if f.has_tensor("cls.weight") or f.has_tensor("cls.output.weight"):
        raise ModelFileError(f.path, "bert classifier heads (rerankers: cls, cls.output) are not supported")
    return EncoderHParams(
        arch=arch,
        n_vocab=int(f.tensor("token_embd.weight").shape[0]),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_ff=n_ff,
        n_positions=int(f.tensor("position_embd.weight").shape[0]),
        n_token_types=int(f.tensor("token_types.weight").shape[0]) if f.has_tensor("token_types.weight") else 0,
        norm_eps=float(f.require(f"{arch}.attention.layer_norm_epsilon")),
    )
