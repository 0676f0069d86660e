"""BERT-style encoders (gguf/encoder.py) on torch: embeddings only, in float.

The GELU is the tanh approximation ggml_gelu computes (transformers' BERT uses the erf form; the two
differ by less than 1e-3 per activation, tests/backends/test_bert.py states the tolerance this gives).

An encoder has no KV cache and no logits: each embedding runs its whole sequence in one forward (every
token attends to every other, so a sequence cannot be chunked), and a sequence here is only its length.
``forward`` (generation, speculation) is refused with a clear error; the engine never calls it on an
encoder server, which serves embeddings only (frontends/cli/embedding_options.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from spekula.backends.gguf.encoder import BLOCK_TENSORS, EncoderHParams, read_encoder_hparams
from spekula.backends.gguf.weights import dequantize
from spekula.core.backend import Backend, BackendOptions, Capture, ModelInfo, SeqInput, SeqOutput
from spekula.core.embedding import Pooling, pool
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile

_NO_CAPTURE = Capture()
ENCODER_ONLY = "this model is an encoder: it computes embeddings only (no generation, no speculation)"


class EncoderTooLong(ValueError):
    """More tokens than the encoder's learned position table (or the batch) holds."""


class TorchEncoderBackend(Backend):
    """Built by backends/torch/backend.py's `backend_class`, which resolves the device and dtype."""

    def __init__(self, model_path: str, options: BackendOptions, device: torch.device, dtype: torch.dtype) -> None:
        self.options = options
        if options.n_ctx <= 0 or options.n_seq_max <= 0:
            raise ConfigError(f"n_ctx and n_seq_max must be positive (got {options.n_ctx}, {options.n_seq_max})")
        self.device, self.dtype = device, dtype
        if options.threads > 0:
            torch.set_num_threads(options.threads)
        f = GGUFFile.shared(model_path)
        self.hparams: EncoderHParams = read_encoder_hparams(f)
        hp = self.hparams
        self.info = ModelInfo(path=str(model_path), arch=hp.arch, name=str(f.get("general.name", f.path.stem)),
                              n_vocab=hp.n_vocab, n_embd=hp.n_embd, n_layer=hp.n_layer, n_ctx_train=hp.n_positions)

        def load(name: str) -> torch.Tensor:
            return torch.from_numpy(dequantize(f.tensor(name), f.path)).to(self.device, self.dtype)

        names = ["token_embd.weight", "position_embd.weight", "token_embd_norm.weight", "token_embd_norm.bias"]
        names += [f"blk.{i}.{stem}.{part}" for i in range(hp.n_layer) for stem in BLOCK_TENSORS
                  for part in ("weight", "bias")]
        if hp.n_token_types:
            names.append("token_types.weight")
        self.w = {name: load(name) for name in names}
        self._lengths: dict[int, int] = {}
        self._next_id = 0

    # ---- sequences: an encoder keeps nothing but how many tokens it last embedded -----------------

    def new_seq(self) -> int:
        if len(self._lengths) >= self.options.n_seq_max:
            raise ConfigError(f"too many live sequences (n_seq_max={self.options.n_seq_max})")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._lengths[seq_id] = 0
        return seq_id

    def free_seq(self, seq_id: int) -> None:
        self._lengths.pop(seq_id, None)

    def _known(self, seq_id: int) -> int:
        if seq_id not in self._lengths:
            raise ConfigError(f"unknown sequence {seq_id}")
        return self._lengths[seq_id]

    def seq_len(self, seq_id: int) -> int:
        return self._known(seq_id)

    def truncate(self, seq_id: int, n_keep: int) -> None:
        self._lengths[seq_id] = max(0, min(int(n_keep), self._known(seq_id)))

    def forward(self, inputs: Sequence[SeqInput], capture: Capture = _NO_CAPTURE) -> list[SeqOutput]:
        raise ConfigError(ENCODER_ONLY)

    def context_shift_refusal(self) -> str | None:
        return ENCODER_ONLY

    # ---- embeddings -------------------------------------------------------------------------------

    def embed(self, seq_id: int, tokens: np.ndarray, pooling: Pooling, n_batch: int) -> np.ndarray:
        """`tokens` through the encoder in one forward, pooled. Non-causal: the whole sequence must fit one
        batch (llama.cpp's rule) and the position table."""
        self._known(seq_id)
        n = len(tokens)
        if n == 0:
            raise ValueError("cannot embed an empty sequence")
        if pooling is Pooling.RANK:
            raise ConfigError("rank pooling is not supported on a bert encoder (it has no classifier head here)")
        if n > self.hparams.n_positions:
            raise EncoderTooLong(f"input ({n} tokens) is longer than the model's position table "
                                 f"({self.hparams.n_positions} positions)")
        if n > n_batch:
            raise EncoderTooLong(f"input ({n} tokens) is too large to process. increase the physical batch size "
                                 f"(current batch size: {n_batch})")
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.hparams.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.hparams.n_vocab})")
        with torch.inference_mode():
            hidden = self.encode(torch.from_numpy(ids).to(self.device))
        self._lengths[seq_id] = n
        return pool(hidden.float().cpu().numpy(), pooling)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [n] -> the last block's hidden states [n, n_embd] (the graph of gguf/encoder.py)."""
        hp, w = self.hparams, self.w
        eps = hp.norm_eps
        x = w["token_embd.weight"][ids] + w["position_embd.weight"][: len(ids)]
        if hp.n_token_types:
            x = x + w["token_types.weight"][0]  # every token is "sentence A", as in llama.cpp
        x = F.layer_norm(x, (hp.n_embd,), w["token_embd_norm.weight"], w["token_embd_norm.bias"], eps)
        n, n_head, head_dim = len(ids), hp.n_head, hp.head_dim
        for i in range(hp.n_layer):
            b = f"blk.{i}."

            def lin(name: str, t: torch.Tensor, b: str = b) -> torch.Tensor:
                return F.linear(t, w[b + name + ".weight"], w[b + name + ".bias"])

            q, k, v = (lin(name, x).view(n, n_head, head_dim).transpose(0, 1) for name in ("attn_q", "attn_k", "attn_v"))
            scores = (q @ k.transpose(1, 2)) * (1.0 / math.sqrt(head_dim))
            attn = (torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v).transpose(0, 1).reshape(n, hp.n_embd)
            x = F.layer_norm(x + lin("attn_output", attn), (hp.n_embd,), w[b + "attn_output_norm.weight"],
                             w[b + "attn_output_norm.bias"], eps)
            ffn = lin("ffn_down", F.gelu(lin("ffn_up", x), approximate="tanh"))  # ggml_gelu's form
            x = F.layer_norm(x + ffn, (hp.n_embd,), w[b + "layer_output_norm.weight"], w[b + "layer_output_norm.bias"],
                             eps)
        return x

