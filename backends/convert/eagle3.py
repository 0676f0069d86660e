"""EAGLE-3 draft checkpoints -> GGUF arch ``eagle3`` (docs/model-formats.md §2).

Accepted layouts: SpecForge ``LlamaForCausalLMEagle3`` and vLLM/AngelSlim ``Eagle3LlamaForCausalLM``
(layer under ``midlayer.``), speculators ``Eagle3Speculator`` (``layers.0.``, Llama fields nested in
``transformer_layer_config``), and any of them with a leading ``model.``. The heads published for
gpt-oss (SpecForge's, NVIDIA Model Optimizer's) keep the layer ids and ``norm_before_fc`` in a nested
``eagle_config``; the ids are layer-input (boundary) indices in [0, N], N being the residual after the
target's last block, as vLLM and llama.cpp read them. The draft layer is a Llama layer, so its Q/K rows
get the llama permutation; ``d2t`` offsets become absolute I64 target ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spekula.backends.convert.draft_vocab import write_d2t, write_embeddings, write_head
from spekula.backends.convert.gguf_writer import GGUFOut, head_dim, head_dim_known, write_decoder_keys
from spekula.backends.convert.plain import write_layer
from spekula.backends.convert.source import HFCheckpoint, merged_text_config, need
from spekula.backends.convert.target import TargetSource
from spekula.core.errors import ModelFileError

EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel")
_LAYER_PREFIXES = ("midlayer.", "model.midlayer.", "layers.0.", "model.layers.0.")
_TOP = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d", "input_norm.weight"}
# What a nested ``eagle_config`` may say; a field at the top wins.
_EAGLE_CONFIG_FIELDS = ("eagle_aux_hidden_state_layer_ids", "norm_before_fc", "norm_before_residual")
# EAGLE-3.1 changes the head's forward; spekula runs EAGLE-3 heads only.
_EAGLE31_FIELDS = ("fc_norm", "norm_output")


def eagle3_config(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("transformer_layer_config")
    cfg = {**config, **nested} if isinstance(nested, dict) else dict(config)
    eagle = config.get("eagle_config")
    if isinstance(eagle, dict):
        for key in _EAGLE_CONFIG_FIELDS:
            if cfg.get(key) is None and eagle.get(key) is not None:
                cfg[key] = eagle[key]
        for key in _EAGLE31_FIELDS:
            cfg.setdefault(key, eagle.get(key))
    return cfg


def is_eagle3(config: dict[str, Any]) -> bool:
    cfg = eagle3_config(config)
    arch = (cfg.get("architectures") or [""])[0]
    return arch in EAGLE3_ARCHS or ("draft_vocab_size" in cfg and cfg.get("num_hidden_layers") == 1)


def convert_eagle3(ckpt: HFCheckpoint, target: TargetSource, outfile: Path, outtype: str, *, pre: str | None) -> Path:
    cfg = eagle3_config(ckpt.config)
    tcfg = merged_text_config(target.config)
    where = ckpt.path
    if int(need(cfg, "num_hidden_layers", where)) != 1:
        raise ModelFileError(where, "an EAGLE-3 draft has exactly one decoder layer (num_hidden_layers == 1)")
    hidden = int(need(cfg, "hidden_size", where))
    n_head = int(need(cfg, "num_attention_heads", where))
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    n_vocab_t = int(need(tcfg, "vocab_size", target.path))
    n_layer_t = int(need(tcfg, "num_hidden_layers", target.path))
    on31 = [key for key in _EAGLE31_FIELDS if cfg.get(key)]
    if on31:
        raise ModelFileError(where, f"is an EAGLE-3.1 head ({', '.join(on31)} set); spekula runs EAGLE-3 heads "
                             "(unsupported: per-feature fc norms, post-norm outputs fed back)")
    if int(cfg.get("vocab_size", n_vocab_t)) != n_vocab_t:
        raise ModelFileError(where, f"vocab_size {cfg['vocab_size']} differs from the target's {n_vocab_t} "
                             f"({target.path}): this head was made for another target")
    declared_hidden = cfg.get("target_hidden_size")
    if declared_hidden is not None and int(declared_hidden) != int(need(tcfg, "hidden_size", target.path)):
        raise ModelFileError(where, f"target_hidden_size {declared_hidden} differs from the hidden size "
                             f"{tcfg['hidden_size']} of the target {target.path}: this head was made for another target")
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or [2, n_layer_t // 2, n_layer_t - 3]
    layers = [int(x) for x in layers]
    if len(layers) != 3 or len(set(layers)) != 3 or not all(0 <= x <= n_layer_t for x in layers):
        raise ModelFileError(where, f"EAGLE-3 needs 3 distinct target layer ids in [0, {n_layer_t}], got {layers}")
    target_hidden = int(cfg.get("target_hidden_size") or need(tcfg, "hidden_size", target.path))
    norm_before_fc = bool(cfg.get("norm_before_fc", False))

    ckpt.require_tensors()
    prefix = next((p for p in _LAYER_PREFIXES if any(n.startswith(p) for n in ckpt.names())), None)
    if prefix is None:
        raise ModelFileError(where, "no EAGLE-3 decoder layer found (expected midlayer.* or layers.0.*)")
    top: dict[str, str] = {}
    for name in ckpt.names():
        if name.startswith(prefix):
            continue
        short = name[len("model."):] if name.startswith("model.") else name
        if short not in _TOP:
            raise ModelFileError(where, f"unexpected tensor {name!r} in an EAGLE-3 checkpoint")
        top[short] = name
    for short in ("fc.weight", "norm.weight"):
        if short not in top:
            raise ModelFileError(where, f"missing tensor {short!r}")
    if ckpt.shape(top["fc.weight"]) != (hidden, 3 * target_hidden):
        raise ModelFileError(where, f"fc.weight shape {ckpt.shape(top['fc.weight'])} != ({hidden}, 3*{target_hidden}) "
                             f"for the target {target.path} (hidden size {target_hidden}): this head was made for "
                             "another target")
    n_vocab_d = int(cfg.get("draft_vocab_size") or n_vocab_t)

    out = GGUFOut(outfile, "eagle3", outtype)
    try:
        w = out.w
        w.add_string("general.name", ckpt.path.name)
        write_decoder_keys(out, {**cfg, "vocab_size": n_vocab_t}, n_layer=1, where=where, llama_style=True,
                           head_dim_keys=head_dim_known(ckpt.config, cfg))
        w.add_array("eagle3.target_layers", layers)
        w.add_uint32("eagle3.target_hidden_size", target_hidden)
        w.add_bool("eagle3.norm_before_residual", bool(cfg.get("norm_before_residual", False)))
        w.add_bool("eagle3.norm_before_fc", norm_before_fc)
        # llama.cpp converts EAGLE-3 as a llama model, whatever the target's architecture
        target.write_vocab(out, vocab_size=n_vocab_t, pre=pre, flavour="llama")

        out.tensor("fc.weight", ckpt.get(top["fc.weight"]))
        if norm_before_fc:
            if "input_norm.weight" not in top:
                raise ModelFileError(where, "norm_before_fc is set but 'input_norm.weight' is missing")
            out.tensor("enc.output_norm.weight", ckpt.get(top["input_norm.weight"]))
        out.tensor("output_norm.weight", ckpt.get(top["norm.weight"]))
        if "embed_tokens.weight" not in top and hidden != int(tcfg.get("hidden_size", hidden)):
            raise ModelFileError(where, f"no embed_tokens and the draft width {hidden} differs from the target's "
                                 f"embeddings ({tcfg.get('hidden_size')})")
        write_embeddings(out, ckpt, top, n_vocab_t, hidden, where)
        if "lm_head.weight" in top:
            write_head(out, ckpt, top, n_vocab_d, hidden, where)
        elif hidden != int(tcfg.get("hidden_size", hidden)):
            raise ModelFileError(where, "no lm_head and the draft width differs from the target's output head")
        write_d2t(out, ckpt, top, n_vocab_d, n_vocab_t, where)

        if ckpt.shape(prefix + "self_attn.q_proj.weight") != (n_head * head_dim(cfg), 2 * hidden):
            raise ModelFileError(where, "q_proj must read [embedding; hidden] (2*hidden_size inputs)")
        if prefix + "hidden_norm.weight" not in ckpt:
            raise ModelFileError(where, f"missing tensor {prefix + 'hidden_norm.weight'!r}")
        out.tensor("blk.0.attn_norm_2.weight", ckpt.get(prefix + "hidden_norm.weight"))
        write_layer(out, ckpt, prefix, "blk.0.", n_head=n_head, n_head_kv=n_head_kv, permute=True,
                    skip=("hidden_norm.weight",))
        return out.finish()
    except BaseException:
        out.abort()
        raise
