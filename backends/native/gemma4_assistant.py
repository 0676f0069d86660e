"""Gemma 4's assistant drafter (llama.cpp's ``gemma4-assistant``) on the native kernels, over a native Gemma 4
target's KV cache.

The step is the torch runtime's (backends/torch/gemma4_assistant.py describes it); the C side
(backends/native/csrc/sk_assistant.c) reads the target context's float16 keys and values where its forward
wrote them (the sliding blocks' rings included), ropes the queries with the target's own tables, and runs
the matmuls on the target's thread pool with int8 activations before quantized weights, as the target does.
So its logits are not bitwise torch's (torch reads float32 keys and multiplies in float32): they agree
within float16 rounding of the cache, and on the tiny fixture the drafts are the same tokens
(tests/drafters/test_gemma4_assistant_native.py). A draft only proposes: the target verifies it either way.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from spekula.backends.native import lib as nl
from spekula.backends.native.backend import NativeBackend
from spekula.backends.native.weights import NativeWeights
from spekula.core.backend import Backend
from spekula.core.drafting.assistant_runtime import AssistantInfo, AssistantRow, AssistantRuntime
from spekula.core.drafting.mtp_runtime import MtpOut
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile

ARCH = "gemma4-assistant"


class NativeGemma4Assistant(AssistantRuntime):
    """The assistant's weights (its quantized ones copied into the target's kernel layout) and its steps."""

    def __init__(self, f: GGUFFile, info: AssistantInfo, target: Backend) -> None:
        self._asst: int | None = None
        if f.architecture != ARCH:
            raise ModelFileError(f.path, f"not a {ARCH} file ({f.architecture})")
        if not isinstance(target, NativeBackend) or target.context is None:
            raise ConfigError(f"a {ARCH} drafter on native reads a native target's KV cache")
        self.info = info
        self._lib = nl.lib()
        self.target = target
        thp = target.hparams
        n_t = thp.n_layer
        if n_t < 2 or not thp.is_sliding(n_t - 2) or thp.is_sliding(n_t - 1):
            # llama.cpp maps the assistant's sliding blocks to the target's block n_layer - 2, its global ones
            # to n_layer - 1; it needs those to be a sliding and a global block
            raise ConfigError(f"a {ARCH} drafter needs a target whose last two blocks are sliding, then global "
                              f"({thp.arch} target {target.info.path})")

        def key(name: str) -> Any:
            return f.require(f"{ARCH}.{name}")

        if int(key("embedding_length_out")) != thp.n_embd:
            raise ConfigError(f"{f.path} drafts for a target of width {int(key('embedding_length_out'))}, "
                              f"the target has {thp.n_embd}")
        if (int(key("attention.sliding_window")) != thp.sliding_window
                or float(key("rope.freq_base")) != thp.rope_base
                or float(key("rope.freq_base_swa")) != thp.rope_base_swa):
            raise ConfigError(f"{f.path}: its window or rope differs from the target's, whose KV it reads")
        n_layer, E, nh = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
        pattern = list(key("attention.sliding_window_pattern"))
        if len(pattern) < n_layer:
            raise ModelFileError(f.path, f"attention.sliding_window_pattern lists {len(pattern)} of {n_layer} blocks")
        kv_of = {True: thp.layout.kv_of(n_t - 2), False: thp.layout.kv_of(n_t - 1)}
        head_dim = {True: thp.block_head_dim(n_t - 2), False: thp.block_head_dim(n_t - 1)}
        w = self._weights = NativeWeights(f, None)
        Et, V = thp.n_embd, thp.n_vocab
        blocks = []
        for i in range(n_layer):
            b, sliding = f"blk.{i}.", bool(pattern[i])
            qd = nh * head_dim[sliding]
            ff = int(w.entry(b + "ffn_gate.weight").shape[0])
            blk = nl.AssistantBlock(sliding=int(sliding), kv_layer=kv_of[sliding])
            for field, name in (("attn_norm", "attn_norm"), ("q_norm", "attn_q_norm"),
                                ("attn_post_norm", "post_attention_norm"), ("ffn_norm", "ffn_norm"),
                                ("ffn_post_norm", "post_ffw_norm")):
                setattr(blk, field, nl.ptr(w.vector(b + name + ".weight")))
            blk.wq = w.matrix(b + "attn_q.weight", shape=(qd, E))
            blk.wo = w.matrix(b + "attn_output.weight", shape=(E, qd))
            blk.w_gate = w.matrix(b + "ffn_gate.weight", shape=(ff, E))
            blk.w_up = w.matrix(b + "ffn_up.weight", shape=(ff, E))
            blk.w_down = w.matrix(b + "ffn_down.weight", shape=(E, ff))
            scale = w.vector(b + "layer_output_scale.weight")
            assert scale is not None
            blk.out_scale = float(scale[0])
            blocks.append(blk)
        self._blocks = (nl.AssistantBlock * n_layer)(*blocks)
        # the target's embedding multiplier as its forward computes it (model_config's embd_scale)
        cfg = nl.ctx_config(target.context)
        embd_scale = float(cfg.embd_scale) if cfg.embd_scale != 0.0 else math.sqrt(Et)
        self._desc = nl.Assistant(
            n_embd=E, n_head=nh, n_layer=n_layer, rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            embd_scale=embd_scale, pre_proj=w.matrix("nextn.pre_projection.weight", shape=(E, 2 * Et)),
            post_proj=w.matrix("nextn.post_projection.weight", shape=(Et, E)),
            embd=w.matrix("token_embd.weight", shape=(V, E)), output_norm=nl.ptr(w.vector("output_norm.weight")),
            blocks=self._blocks)
        asst = self._lib.sk_asst_new(ctypes.byref(self._desc), target.context)
        if not asst:
            raise ConfigError(f"cannot create the native runtime of {f.path} over {target.info.path}: its shapes "
                              "do not fit the target's, or out of memory")
        self._asst = int(asst)

    def close(self) -> None:
        if self._asst is not None:
            self._lib.sk_asst_free(self._asst)
            self._asst = None

    def __del__(self) -> None:
        self.close()

    def step(self, rows: Sequence[AssistantRow]) -> list[MtpOut]:
        if self._asst is None or self.target.context is None:
            raise ConfigError(f"the native {ARCH} runtime (or its target) is closed")
        if not rows:
            return []
        for r in rows:
            if r.pos <= 0:
                raise ConfigError(f"{ARCH}: a draft at position {r.pos} has no target keys to read")
            if r.pos > self.target.seq_len(r.target_seq):
                raise ConfigError(f"{ARCH}: the target's cache of sequence {r.target_seq} holds "
                                  f"{self.target.seq_len(r.target_seq)} positions, a draft at {r.pos} needs {r.pos}")
        n, Et = len(rows), self.target.hparams.n_embd
        tokens = np.array([r.token for r in rows], np.int32)
        pos = np.array([r.pos for r in rows], np.int32)
        slots = np.array([self.target.kv_slot(r.target_seq) for r in rows], np.int32)
        hidden = np.ascontiguousarray(np.stack([np.asarray(r.hidden, np.float32).reshape(Et) for r in rows]))
        logits = np.empty((n, self.target.hparams.n_vocab), np.float32)
        hout = np.empty((n, Et), np.float32)
        rc = self._lib.sk_asst_step(self._asst, n, nl.ptr(tokens), nl.ptr(pos), nl.ptr(slots), nl.ptr(hidden),
                                    nl.ptr(logits), nl.ptr(hout))
        if rc == -1:
            raise MemoryError(f"native {ARCH} step: out of memory for its scratch")
        if rc != 0:
            raise ConfigError(f"native {ARCH} step: the target's cache no longer holds the keys a row reads "
                              f"(positions {pos.tolist()})")
        return [MtpOut(logits[i], hout[i]) for i in range(n)]


runtime_class = NativeGemma4Assistant
