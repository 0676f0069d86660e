"""Build the head a run configuration names, over its target's frozen embeddings and output head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spekula.backends.torch.draft_common import target_embeddings
from spekula.core.errors import ConfigError
from spekula.training.feature_cache import FeatureCache
from spekula.training.head_api import DraftHead, TargetFacts

if TYPE_CHECKING:
    from spekula.training.run_config import RunConfig

HEAD_KINDS = ("eagle3", "dflash")


def default_layers(kind: str, n_layer: int) -> tuple[int, ...]:
    """The target layer inputs a head of ``kind`` reads by default (both kinds share them, so one
    distillation cache serves both)."""
    if kind == "eagle3":
        from spekula.training.eagle3_head import default_eagle3_layers

        return tuple(default_eagle3_layers(n_layer))
    if kind == "dflash":
        from spekula.training.dflash_head import default_dflash_layers

        return tuple(default_dflash_layers(n_layer))
    raise ConfigError(f"unknown drafter kind {kind!r}; choose one of {', '.join(HEAD_KINDS)}")


def build_head(cfg: RunConfig, facts: TargetFacts, cache: FeatureCache, device: torch.device) -> DraftHead:
    kind, seed, opts = cfg.kind, cfg.seed, dict(cfg.head)
    embd, head = target_embeddings(facts.path, device, torch.float32)
    if kind == "eagle3":
        from spekula.training.eagle3_head import Eagle3Head, Eagle3HeadOptions

        o = Eagle3HeadOptions(**{**opts, "layers": tuple(opts["layers"]) if opts.get("layers") else None})
        return Eagle3Head.create(facts, embd, head, cache.label_counts(facts.n_vocab), o, seed).to(device)
    if kind == "dflash":
        from spekula.training.dflash_head import DFlashHead, DFlashHeadOptions, mask_token_for

        if opts.get("mask_token_id") is None:  # a control token the data never contains
            opts["mask_token_id"] = mask_token_for(facts.path, cache.token_counts(facts.n_vocab))
        o = DFlashHeadOptions(**{**opts, "layers": tuple(opts["layers"]) if opts.get("layers") else None})
        return DFlashHead.create(facts, embd, head, o, seed, cache.label_counts(facts.n_vocab)).to(device)
    raise ConfigError(f"unknown drafter kind {kind!r}; choose one of {', '.join(HEAD_KINDS)}")
