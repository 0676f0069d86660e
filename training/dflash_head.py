"""The trainable DFlash draft head: the forward the torch DFlash runtime computes on its converted GGUF.

Target features at positions < a become extra keys/values of every draft layer; the block
``[x_a, MASK, ...]`` at positions a.. then runs non-causally over them and itself, and block index j
proposes the token at a + j. Training samples several anchors a per sequence and runs all their
blocks in one forward: the context K/V are computed once per layer, and a boolean mask gives each
block row the context before its own anchor and its own block's rows.

The head borrows the target's token embeddings (also for MASK) and full-vocabulary output head as
frozen buffers and trains against the whole vocabulary. Its export keeps the embeddings out (the draft
runtime falls back to the target's) and, with a draft vocabulary (``draft_vocab``), the target head's
rows of the most frequent labels as its own head with ``d2t``: a draft then costs a fraction of the
output head and proposes the same token wherever the whole head's best is among those rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from spekula.backends.torch.draft_common import apply_rope, rms_norm, rope_angles
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.training.eagle3_head import default_eagle3_layers, draft_vocabulary
from spekula.training.head_api import HeadMetrics, TargetFacts, TrainBatch, soft_cross_entropy
from spekula.training.head_vocabulary import checked_draft_ids

# tokenizer.ggml.token_type values (GGUF's TokenType enum)
_CONTROL, _UNUSED = 3, 5
_INIT_STD = 0.02


@dataclass(frozen=True)
class DFlashHeadOptions:
    n_layer: int = 2
    block_size: int = 8  # the block [last, MASK * (block_size - 1)] drafts up to block_size - 1 tokens
    n_ff: int | None = None  # None: the target's
    anchors_per_seq: int = 32  # block anchors sampled per sequence per batch
    pos_decay: float = 0.8  # block index j weighs pos_decay ** (j - 1) in the loss
    mask_token_id: int | None = None  # create() needs one: mask_token_for(target, label counts)
    layers: tuple[int, ...] | None = None  # target layer-input indices; None: default_dflash_layers
    # The exported head keeps the target head's rows of this many most frequent labels (None or the
    # whole vocabulary: the runtime borrows the target's head). On SmolLM2 a draft's output head over
    # the 49k vocabulary was about a third of a DFlash call's time.
    draft_vocab: int | None = 8192


def default_dflash_layers(n_layer: int) -> tuple[int, ...]:
    """The EAGLE-3 head's default layer inputs, so one feature cache serves both kinds; DFlash cannot
    read the embeddings (input 0: HF ids start at the first block's output), so a target of under
    three layers gives every layer output it has."""
    if n_layer < 1:
        raise ValueError(f"a target needs at least one layer, got {n_layer}")
    if n_layer < 3:
        return tuple(range(1, n_layer + 1))
    return tuple(default_eagle3_layers(n_layer))


def choose_mask_token(token_types: Sequence[int], counts: Sequence[int] | np.ndarray) -> int:
    """The id the draft uses as MASK: one the training data never contains (``counts[id] == 0``),
    preferring the highest-id CONTROL token, else the highest-id UNUSED one. ``counts`` covers the
    whole embedding table; ids past the token list (rows no tokenizer entry names) count as unused."""
    counts = np.asarray(counts)
    types = np.full(len(counts), _UNUSED, dtype=np.int64)
    n = min(len(token_types), len(counts))
    types[:n] = np.asarray(token_types, dtype=np.int64)[:n]
    unseen = counts == 0
    for kind in (_CONTROL, _UNUSED):
        ids = np.flatnonzero(unseen & (types == kind))
        if len(ids):
            return int(ids[-1])
    raise ConfigError("no control or unused token is absent from the training data: "
                      "set the DFlash mask token id explicitly")


def mask_token_for(target_path: str, counts: Sequence[int] | np.ndarray) -> int:
    """:func:`choose_mask_token` over the token types of a target GGUF."""
    f = GGUFFile(target_path)
    types = f.get("tokenizer.ggml.token_type")
    if types is None:
        raise ModelFileError(f.path, "no tokenizer.ggml.token_type: set the DFlash mask token id explicitly")
    return choose_mask_token([int(t) for t in types], counts)


class _RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class _Attention(nn.Module):
    def __init__(self, d: TargetFacts) -> None:
        super().__init__()
        self.n_head, self.n_head_kv, self.head_dim = d.n_head, d.n_head_kv, d.head_dim
        self.q_proj = _linear(d.n_embd, d.n_head * d.head_dim)
        self.k_proj = _linear(d.n_embd, d.n_head_kv * d.head_dim)
        self.v_proj = _linear(d.n_embd, d.n_head_kv * d.head_dim)
        self.o_proj = _linear(d.n_head * d.head_dim, d.n_embd)
        self.q_norm = _RMSNorm(d.head_dim, d.rms_eps)
        self.k_norm = _RMSNorm(d.head_dim, d.rms_eps)

    def keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, N, H] -> k, v [B, N, Hkv, hd] (k normed and rotated at the rows' positions)."""
        B, N, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B * N, self.n_head_kv, self.head_dim))
        k = apply_rope(k, *rope, neox=True).view(B, N, self.n_head_kv, self.head_dim)
        return k, self.v_proj(x).view(B, N, self.n_head_kv, self.head_dim)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Block rows h [B, Q, H] over [context | block] keys, ``mask`` [B, 1, Q, T + Q] (True: attend)."""
        B, Q, _ = h.shape
        q = self.q_norm(self.q_proj(h).view(B * Q, self.n_head, self.head_dim))
        q = apply_rope(q, *rope, neox=True).view(B, Q, self.n_head, self.head_dim)
        k, v = self.keys_values(h, rope)
        k, v = torch.cat([ctx_k, k], dim=1), torch.cat([ctx_v, v], dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim),
                                             enable_gqa=self.n_head != self.n_head_kv)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.n_head * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, d: TargetFacts) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(d.n_embd, d.n_ff), _linear(d.n_embd, d.n_ff)
        self.down_proj = _linear(d.n_ff, d.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, d: TargetFacts) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(d.n_embd, d.rms_eps)
        self.self_attn = _Attention(d)
        self.post_attention_layernorm = _RMSNorm(d.n_embd, d.rms_eps)
        self.mlp = _MLP(d)


def _hf_name(name: str) -> str:
    return "layers." + name.removeprefix("blocks.") if name.startswith("blocks.") else name


def _own_name(hf_name: str) -> str:
    return "blocks." + hf_name.removeprefix("layers.") if hf_name.startswith("layers.") else hf_name


class DFlashHead(nn.Module):
    """A DFlash draft head; its parameter names are the z-lab checkpoint's (``blocks.`` for ``layers.``)."""

    kind = "dflash"
    target_embd: torch.Tensor
    target_head: torch.Tensor

    def __init__(self, dims: TargetFacts, embd: torch.Tensor, head: torch.Tensor, options: DFlashHeadOptions,
                 draft_ids: np.ndarray | None = None) -> None:
        super().__init__()
        if options.layers is None or options.mask_token_id is None:
            raise ValueError("DFlashHead needs resolved layers and mask_token_id (use create or from_hf)")
        if options.block_size < 2:
            raise ValueError(f"block_size {options.block_size} < 2")
        if embd.shape[1] != dims.n_embd or head.shape[1] != dims.n_embd:
            raise ValueError(f"target embeddings {tuple(embd.shape)} / head {tuple(head.shape)} are not {dims.n_embd} wide")
        if not 0 <= options.mask_token_id < embd.shape[0]:
            raise ValueError(f"mask_token_id {options.mask_token_id} is outside the vocabulary ({embd.shape[0]})")
        self.dims, self.options = dims, options
        self.layers: tuple[int, ...] = tuple(options.layers)
        self.block_size, self.mask_token_id = options.block_size, options.mask_token_id
        self.fc = _linear(len(self.layers) * dims.n_embd, dims.n_embd)
        self.hidden_norm = _RMSNorm(dims.n_embd, dims.rms_eps)
        # "blocks" here, "layers" in the checkpoint: DraftHead.layers names the target layers read
        self.blocks = nn.ModuleList(_Layer(dims) for _ in range(options.n_layer))
        self.norm = _RMSNorm(dims.n_embd, dims.rms_eps)
        # Frozen and not part of the state: the runtime takes them from the target file.
        self.register_buffer("target_embd", embd.detach(), persistent=False)
        self.register_buffer("target_head", head.detach(), persistent=False)
        # Target ids of the exported head's rows (ascending), or None: it borrows the whole head.
        self.draft_ids = None if draft_ids is None else checked_draft_ids(draft_ids, embd.shape[0])

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def create(cls, facts: TargetFacts, embd: torch.Tensor, head: torch.Tensor, options: DFlashHeadOptions,
               seed: int, label_counts: np.ndarray | None = None) -> DFlashHead:
        """A freshly initialised head of the target's width (weights from a generator seeded by ``seed``);
        its draft vocabulary, when ``options.draft_vocab`` is below the target's, from ``label_counts``."""
        layers = options.layers if options.layers is not None else default_dflash_layers(facts.n_layer)
        bad = [x for x in layers if not 1 <= x <= facts.n_layer]
        if not layers or bad or len(set(layers)) != len(layers):
            raise ConfigError(f"DFlash layers {list(layers)} must be distinct layer inputs in 1..{facts.n_layer}")
        if options.mask_token_id is None:
            raise ConfigError("DFlash needs a mask token id: pick one with mask_token_for(target path, label counts)")
        dims = replace(facts, n_ff=options.n_ff or facts.n_ff)
        ids = None
        if options.draft_vocab is not None and options.draft_vocab < 1:
            raise ConfigError(f"draft_vocab must be >= 1, got {options.draft_vocab}")
        if options.draft_vocab is not None and options.draft_vocab < facts.n_vocab:
            if label_counts is None or np.asarray(label_counts).size != facts.n_vocab:
                raise ConfigError(f"a DFlash draft vocabulary needs label counts over the {facts.n_vocab} target ids")
            ids = draft_vocabulary(np.asarray(label_counts), options.draft_vocab)
        module = cls(dims, embd, head, replace(options, layers=tuple(layers), n_ff=dims.n_ff), ids)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in module.named_parameters():  # fixed order: the same seed gives the same head
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * _INIT_STD)
        return module.to(embd.device)

    @classmethod
    def from_hf(cls, config: dict[str, Any], tensors: dict[str, np.ndarray], embd: torch.Tensor, head: torch.Tensor,
                facts: TargetFacts, options: DFlashHeadOptions | None = None) -> DFlashHead:
        """A head from a z-lab DFlash checkpoint (as :meth:`hf_checkpoint` writes); the training-only
        settings (anchors_per_seq, pos_decay) come from ``options``."""
        if (config.get("architectures") or [""])[0] != "DFlashDraftModel":
            raise ModelFileError("config.json", f"not a DFlashDraftModel: {config.get('architectures')}")
        if int(config["hidden_size"]) != facts.n_embd:
            raise ModelFileError("config.json", f"hidden_size {config['hidden_size']} != the target's {facts.n_embd}")
        dcfg = config["dflash_config"]
        n_head = int(config["num_attention_heads"])
        dims = replace(facts, n_head=n_head, n_head_kv=int(config.get("num_key_value_heads") or n_head),
                       head_dim=int(config.get("head_dim") or facts.n_embd // n_head),
                       n_ff=int(config["intermediate_size"]), rope_theta=float(config.get("rope_theta", facts.rope_theta)),
                       rms_eps=float(config.get("rms_norm_eps", facts.rms_eps)),
                       n_ctx_train=int(config.get("max_position_embeddings", facts.n_ctx_train)))
        opts = replace(options or DFlashHeadOptions(), n_layer=int(config["num_hidden_layers"]),
                       block_size=int(dcfg.get("block_size", config.get("block_size", 16))), n_ff=dims.n_ff,
                       mask_token_id=int(dcfg["mask_token_id"]),
                       layers=tuple(int(i) + 1 for i in dcfg["target_layer_ids"]))
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
        ids = None
        if "d2t" in tensors:  # a draft vocabulary: lm_head must be the target head's rows (frozen here)
            offsets = np.asarray(tensors.pop("d2t"), dtype=np.int64).reshape(-1)
            ids = offsets + np.arange(offsets.size)
            rows = np.asarray(tensors.pop("lm_head.weight", np.empty(0)), dtype=np.float32)
            if rows.shape != (ids.size, facts.n_embd) or ids.min() < 0 or ids.max() >= head.shape[0] or \
                    not np.array_equal(rows, head[torch.from_numpy(ids)].float().cpu().numpy()):
                raise ModelFileError("model.safetensors", "lm_head is not the target head's rows of d2t: a head "
                                     "trained here keeps the target's head frozen")
        module = cls(dims, embd, head, replace(opts, draft_vocab=None if ids is None else int(ids.size)), ids)
        state = {_own_name(k): torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in tensors.items()}
        module.load_state_dict(state, strict=True)
        return module.to(embd.device)

    # --- forward ---------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions, self.dims.head_dim, self.dims.rope_theta, 1.0, None)

    def block_hidden(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Normed block rows [B, A, block_size, H] for anchors [B, A] (each 0 <= a < T).

        features [B, T, len(layers) * H] and tokens [B, T] are the sequences; anchor a's block holds
        tokens[a] then MASKs at positions a.., over the features of positions < a.
        """
        B, T, _ = features.shape
        A, S, dev = anchors.shape[1], self.block_size, features.device
        Q = A * S
        dtype = self.fc.weight.dtype
        c = self.hidden_norm(self.fc(features.to(dtype)))
        ctx_rope = self._rope(torch.arange(T, device=dev).repeat(B))
        block_pos = (anchors[:, :, None] + torch.arange(S, device=dev)).reshape(B * Q)
        block_rope = self._rope(block_pos)
        block_tok = torch.full((B, A, S), self.mask_token_id, dtype=torch.long, device=dev)
        block_tok[:, :, 0] = tokens.gather(1, anchors)
        x = self.target_embd[block_tok.view(B, Q)].to(dtype)
        # Row r of anchor a sees context keys at positions < a and every row of its own block.
        row_anchor = anchors.repeat_interleave(S, dim=1)  # [B, Q]
        sees_ctx = torch.arange(T, device=dev)[None, None, :] < row_anchor[:, :, None]
        block_of = torch.arange(A, device=dev).repeat_interleave(S)
        sees_block = (block_of[:, None] == block_of[None, :]).expand(B, Q, Q)
        mask = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]
        for layer in self.blocks:
            ctx_k, ctx_v = layer.self_attn.keys_values(c, ctx_rope)
            x = x + layer.self_attn(layer.input_layernorm(x), block_rope, ctx_k, ctx_v, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).view(B, A, S, self.dims.n_embd)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (float32) of normed rows, through the target's head."""
        return F.linear(hidden.to(self.target_head.dtype), self.target_head).float()

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Block logits [B, A, block_size, V]; index j proposes the token at anchor + j."""
        return self.logits(self.block_hidden(features, tokens, anchors))

    # --- training --------------------------------------------------------------------------------
    def sample_anchors(self, batch: TrainBatch, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [B, A], used [B, A]): up to anchors_per_seq distinct anchors a >= 1 per sequence
        whose block has at least one counted target; unused slots (short sequences) hold 0."""
        counted = batch.valid & batch.loss_mask
        B, T = counted.shape
        S = self.block_size
        # block index j (1..S-1) of anchor a is scored against label a + j - 1
        padded = F.pad(counted, (0, S - 2))
        has_target = padded.unfold(1, S - 1, 1).any(-1)
        candidate = has_target & batch.valid
        candidate[:, 0] = False
        scores = torch.rand(B, T, generator=gen, device=gen.device).to(counted.device)
        scores = scores.masked_fill(~candidate, -1.0)
        top, idx = scores.topk(min(self.options.anchors_per_seq, T), dim=1)
        used = top >= 0
        return torch.where(used, idx, 0), used

    def loss(self, batch: TrainBatch, gen: torch.Generator) -> tuple[torch.Tensor, HeadMetrics]:
        anchors, used = self.sample_anchors(batch, gen)
        B, T = batch.labels.shape
        S, dev = self.block_size, batch.labels.device
        offsets = torch.arange(S - 1, device=dev)  # block index j - 1
        at = anchors[:, :, None] + offsets  # label index a + j - 1, [B, A, S-1]
        inside = at < T
        at_c = at.clamp(max=T - 1).view(B, -1)
        counted = (batch.valid & batch.loss_mask).gather(1, at_c).view_as(at) & inside & used[:, :, None]
        labels = batch.labels.gather(1, at_c).view_as(at)
        # Padding never reaches the keys: masked-out NaN or inf features would still poison the softmax.
        features = torch.where(batch.valid[..., None], batch.features, 0.0)
        rows = self.block_hidden(features, batch.tokens, anchors)[:, :, 1:]
        if not bool(counted.any()):
            return rows.sum() * 0.0, HeadMetrics([0.0] * (S - 1), [0.0] * (S - 1))
        logits = self.logits(rows[counted])
        target = labels[counted]
        j = offsets.expand_as(at)[counted]
        weight = torch.tensor(self.options.pos_decay, device=dev, dtype=torch.float32) ** j.float()
        if batch.soft_ids is not None and batch.soft_logp is not None:  # learn the target's top-K
            K = batch.soft_ids.shape[-1]
            where = at_c[..., None].expand(-1, -1, K)
            ids = batch.soft_ids.gather(1, where).view(*at.shape, K)[counted]
            logp = batch.soft_logp.gather(1, where).view(*at.shape, K)[counted]
            ce = soft_cross_entropy(logits, ids, logp)
        else:
            ce = F.cross_entropy(logits, target, reduction="none")
        loss = (weight * ce).sum() / weight.sum()
        with torch.no_grad():
            hit = (logits.argmax(-1) == target).float()
            correct = torch.zeros(S - 1, device=dev).index_add_(0, j, hit)
            count = torch.zeros(S - 1, device=dev).index_add_(0, j, torch.ones_like(hit))
        return loss, HeadMetrics(correct.tolist(), count.tolist())

    # --- export ----------------------------------------------------------------------------------
    def hf_checkpoint(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """z-lab ``DFlashDraftModel`` config and float32 tensors: no embeddings (the target's), and no head
        but the target head's rows of the draft vocabulary with their ``d2t`` (HF offsets) where it has one."""
        d = self.dims
        config: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": d.n_embd, "intermediate_size": d.n_ff, "num_attention_heads": d.n_head,
            "num_key_value_heads": d.n_head_kv, "head_dim": d.head_dim, "num_hidden_layers": len(self.blocks),
            "vocab_size": int(self.target_embd.shape[0]), "rms_norm_eps": d.rms_eps, "rope_theta": d.rope_theta,
            "max_position_embeddings": d.n_ctx_train, "tie_word_embeddings": False,
            "dflash_config": {"target_layer_ids": [x - 1 for x in self.layers],
                              "mask_token_id": self.mask_token_id, "block_size": self.block_size},
        }
        tensors = {_hf_name(k): v.detach().float().cpu().numpy() for k, v in self.state_dict().items()}
        if self.draft_ids is not None:
            ids = self.draft_ids
            config["draft_vocab_size"] = int(ids.size)
            tensors["lm_head.weight"] = self.target_head[torch.from_numpy(ids).to(self.target_head.device)] \
                .detach().float().cpu().numpy()
            tensors["d2t"] = ids - np.arange(ids.size, dtype=np.int64)
        return config, tensors
