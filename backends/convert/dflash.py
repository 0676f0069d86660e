"""DFlash and DSpark draft checkpoints (Qwen3 backbone) -> GGUF arch ``dflash`` (docs/model-formats.md §3, §4).

HF layer ids name block *outputs*; GGUF stores layer-input indices, so ids are written +1. The draft
borrows the target's embeddings and head, so its width must equal the target's. Features this
runtime does not implement (sliding window, value scale, soft-capping, DFlash2 convolutions, Gemma
targets) are rejected here rather than written into a file that would then decode differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from spekula.backends.convert.draft_vocab import write_d2t, write_embeddings, write_head
from spekula.backends.convert.gguf_writer import GGUFOut, head_dim, head_dim_known, write_decoder_keys
from spekula.backends.convert.plain import _REQUIRED, write_layer
from spekula.backends.convert.source import HFCheckpoint, merged_text_config, need
from spekula.backends.convert.target import TargetSource
from spekula.backends.convert.vocab import vocab_flavour
from spekula.core.errors import ModelFileError

DFLASH_ARCHS = ("DFlashDraftModel",)
DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator")
_UNSUPPORTED_ARCHS = ("DFlash2DraftModel", "Lfm2DSparkDraftModel", "LingDSparkModel",
                      "DeepseekV4DSparkModel", "Gemma4DSparkModel")
_TOP = {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight", "d2t", "t2d",
        "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
        "confidence_head.proj.weight", "confidence_head.proj.bias"}
_UNSUPPORTED_FIELDS = ("attention_value_scale", "output_multiplier", "final_logit_softcapping",
                       "input_embedding_scale", "partial_rotary_factor", "conv_kernel_size", "selector_rank")


def dflash_kind(config: dict[str, Any]) -> str | None:
    """'dflash', 'dspark', or None when the config is neither."""
    arch = (config.get("architectures") or [""])[0]
    if arch in _UNSUPPORTED_ARCHS:
        raise ModelFileError("config.json", f"architecture {arch!r} is not supported by this converter")
    if arch in DSPARK_ARCHS or "markov_head_type" in config:
        return "dspark"
    if arch in DFLASH_ARCHS or "dflash_config" in config:
        return "dflash"
    return None


def _de_interleave(w: np.ndarray, hd: int) -> np.ndarray:
    """Interleaved-rope rows -> NEOX rows (per head: even dims first, then odd)."""
    shape = w.shape
    return w.reshape(-1, hd // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def convert_dflash(ckpt: HFCheckpoint, target: TargetSource, outfile: Path, outtype: str, *, pre: str | None) -> Path:
    raw = ckpt.config
    kind = dflash_kind(raw)
    where = ckpt.path
    speculators = "transformer_layer_config" in raw or "aux_hidden_state_layer_ids" in raw
    cfg = {**raw, **raw["transformer_layer_config"]} if isinstance(raw.get("transformer_layer_config"), dict) else dict(raw)
    dcfg: dict[str, Any] = dict(cfg.get("dflash_config") or {})
    if "aux_hidden_state_layer_ids" in cfg:
        dcfg.setdefault("target_layer_ids", [int(i) - 1 for i in cfg["aux_hidden_state_layer_ids"]])
    for key in ("target_layer_ids", "mask_token_id", "block_size"):
        if key not in dcfg and key in cfg:
            dcfg[key] = cfg[key]
    tcfg = merged_text_config(target.config)
    if str((tcfg.get("architectures") or [""])[0]).startswith("Gemma"):
        raise ModelFileError(target.path, "Gemma targets (scaled embeddings) are not supported")
    for field in _UNSUPPORTED_FIELDS:
        if cfg.get(field) is not None or dcfg.get(field) is not None:
            raise ModelFileError(where, f"config field {field!r} is not supported by this runtime")
    if cfg.get("use_sliding_window") or dcfg.get("use_swa"):
        raise ModelFileError(where, "sliding-window DFlash drafts are not supported")
    if kind == "dspark" and cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise ModelFileError(where, f"markov_head_type {cfg['markov_head_type']!r} is not supported (only 'vanilla')")
    if (where / "mask_embedding.pt").is_file():
        raise ModelFileError(where, "mask_embedding.pt checkpoints are not supported")

    hidden = int(need(cfg, "hidden_size", where))
    n_layer = int(need(cfg, "num_hidden_layers", where))
    n_head = int(need(cfg, "num_attention_heads", where))
    n_vocab_t = int(need(tcfg, "vocab_size", target.path))
    n_layer_t = int(need(tcfg, "num_hidden_layers", target.path))
    if hidden != int(need(tcfg, "hidden_size", target.path)):
        raise ModelFileError(where, f"draft hidden_size {hidden} != target hidden_size {tcfg['hidden_size']}")
    if int(cfg.get("vocab_size", n_vocab_t)) != n_vocab_t:
        raise ModelFileError(where, f"vocab_size {cfg['vocab_size']} differs from the target's {n_vocab_t}")
    ids = [int(i) for i in dcfg.get("target_layer_ids") or []]
    if not ids or not all(0 <= i < n_layer_t for i in ids):
        raise ModelFileError(where, f"target_layer_ids {ids} must be non-empty ids in [0, {n_layer_t})")
    mask_id = dcfg.get("mask_token_id")
    if mask_id is None or not 0 <= int(mask_id) < n_vocab_t:
        raise ModelFileError(where, f"mask_token_id {mask_id!r} missing or outside the target vocabulary")
    block_size = int(dcfg.get("block_size", 16))
    if block_size < 2:
        raise ModelFileError(where, f"block_size {block_size} < 2")

    ckpt.require_tensors()
    top: dict[str, str] = {}
    for name in ckpt.names():
        short = name[len("model."):] if name.startswith("model.") else name
        if short.startswith("layers."):
            continue
        if short not in _TOP or (kind == "dflash" and short.split(".")[0] in ("markov_head", "confidence_head")):
            raise ModelFileError(where, f"unexpected tensor {name!r} in a {kind} checkpoint")
        top[short] = name
    for short in ("fc.weight", "hidden_norm.weight", "norm.weight") + (
        ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight") if kind == "dspark" else ()
    ):
        if short not in top:
            raise ModelFileError(where, f"missing tensor {short!r}")
    if ckpt.shape(top["fc.weight"]) != (hidden, len(ids) * hidden):
        raise ModelFileError(where, f"fc.weight shape {ckpt.shape(top['fc.weight'])} != ({hidden}, {len(ids)}*{hidden})")
    n_vocab_d = int(cfg.get("draft_vocab_size") or n_vocab_t)
    layer_prefix = "model.layers." if any(n.startswith("model.layers.") for n in ckpt.names()) else "layers."

    out = GGUFOut(outfile, "dflash", outtype)
    try:
        w = out.w
        w.add_string("general.name", ckpt.path.name)
        write_decoder_keys(out, cfg, n_layer=n_layer, where=where, llama_style=False, head_dim_keys=head_dim_known(raw, cfg))
        w.add_uint32("dflash.block_size", block_size)
        w.add_array("dflash.target_layers", [i + 1 for i in ids])
        causal = cfg.get("is_causal", dcfg.get("causal"))
        if causal is not None:
            w.add_bool("dflash.attention.causal", bool(causal))
        # the vocabulary is converted as the target's own converter would convert it
        target.write_vocab(out, vocab_size=n_vocab_t, pre=pre, flavour=vocab_flavour(target.config),
                           mask_token_id=int(mask_id))

        out.tensor("fc.weight", ckpt.get(top["fc.weight"]))
        out.tensor("enc.output_norm.weight", ckpt.get(top["hidden_norm.weight"]))
        out.tensor("output_norm.weight", ckpt.get(top["norm.weight"]))
        write_embeddings(out, ckpt, top, n_vocab_t, hidden, where)
        # DSpark keeps its own head only for a reduced vocabulary (else the target's head is used).
        if "lm_head.weight" in top and (kind == "dflash" or n_vocab_d < n_vocab_t):
            write_head(out, ckpt, top, n_vocab_d, hidden, where)
        write_d2t(out, ckpt, top, n_vocab_d, n_vocab_t, where)
        if kind == "dspark":
            w1, w2 = ckpt.get(top["markov_head.markov_w1.weight"]), ckpt.get(top["markov_head.markov_w2.weight"])
            if w1.ndim != 2 or w1.shape[0] != n_vocab_t or w2.shape != (n_vocab_d, w1.shape[1]):
                raise ModelFileError(where, f"markov head shapes {w1.shape}, {w2.shape} do not fit V={n_vocab_t}, Vd={n_vocab_d}")
            out.tensor("markov_w1.weight", w1)
            out.tensor("markov_w2.weight", w2)
            has_conf = "confidence_head.proj.weight" in top
            if has_conf:
                pw = ckpt.get(top["confidence_head.proj.weight"])
                if pw.shape != (1, hidden + w1.shape[1]):
                    raise ModelFileError(where, f"confidence_head.proj shape {pw.shape} != (1, {hidden + w1.shape[1]})")
                out.tensor("conf_proj.weight", pw, keep_f32=True)
                bias = ckpt.get(top["confidence_head.proj.bias"]) if "confidence_head.proj.bias" in top else np.zeros(1, np.float32)
                out.tensor("conf_proj.bias", bias)
            w.add_bool("dflash.sample_from_anchor", bool(cfg.get("sample_from_anchor", not speculators)))
            w.add_bool("dflash.has_confidence_head", has_conf)

        hd = head_dim(cfg)
        neox = bool(cfg.get("rope_is_neox_style", True))
        required = _REQUIRED + ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
        for i in range(n_layer):
            prefix = f"{layer_prefix}{i}."
            if neox:
                write_layer(out, ckpt, prefix, f"blk.{i}.", n_head=n_head, n_head_kv=0, permute=False, required=required)
                continue
            # Interleaved-rope checkpoints: de-interleave q/k rows and norms so NEOX rope applies.
            view = _DeInterleaved(ckpt, prefix, hd)
            write_layer(out, view, prefix, f"blk.{i}.", n_head=n_head, n_head_kv=0, permute=False, required=required)  # type: ignore[arg-type]
        beyond = [n for n in ckpt.names() if n.startswith(f"{layer_prefix}{n_layer}.")]
        if beyond:
            raise ModelFileError(where, f"tensors beyond num_hidden_layers={n_layer}: {beyond[:3]}")
        return out.finish()
    except BaseException:
        out.abort()
        raise


class _DeInterleaved:
    """A checkpoint view whose q/k projections and norms under one prefix come back de-interleaved."""

    _SUFFIXES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")

    def __init__(self, ckpt: HFCheckpoint, prefix: str, hd: int) -> None:
        self.ckpt, self.prefix, self.hd, self.path = ckpt, prefix, hd, ckpt.path

    def names(self) -> list[str]:
        return self.ckpt.names()

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def get(self, name: str) -> np.ndarray:
        data = self.ckpt.get(name)
        if name.startswith(self.prefix) and name[len(self.prefix):] in self._SUFFIXES:
            return _de_interleave(data, self.hd)
        return data
