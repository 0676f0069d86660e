"""Mixture-of-experts checkpoints (Qwen3MoeForCausalLM, Glm4MoeForCausalLM) -> qwen3moe / glm4moe GGUF.

Names, keys and tensor types follow llama.cpp's converter, so llama.cpp loads what we write. Routed
experts are stacked into one [n_expert, out, in] tensor per projection; checkpoints may hold them per
expert (the published layout) or fused as transformers 5 keeps them in memory (``gate_up_proj``).
GLM's multi-token-prediction ("nextn") layers follow the trunk as extra blocks: ``mtp="drop"`` leaves
them out (``--no-mtp``), ``mtp="only"`` writes the draft file of ``--mtp`` (the MTP blocks with the
trunk's embedding, final norm and head; block numbering and keys stay those of the whole model).
Settings that the qwen3moe graph cannot express (unnormalised top-k, dense layers) are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spekula.backends.convert.gguf_writer import GGUFOut, head_dim, write_decoder_keys
from spekula.backends.convert.plain import ATTN_MAP
from spekula.backends.convert.source import HFCheckpoint, need
from spekula.backends.convert.vocab import vocab_flavour, write_vocab
from spekula.backends.gguf.recipes import ARCHITECTURES, MoERecipe
from spekula.core.errors import ConfigError, ModelFileError

MOE_ARCHS = {"Qwen3MoeForCausalLM": "qwen3moe", "Glm4MoeForCausalLM": "glm4moe"}
MTP_MODES = ("keep", "drop", "only")

_DENSE = {"mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}
_SHARED = {"mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
           "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
           "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}
_ROUTER = {"mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
_NEXTN = {"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
          "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight",
          "shared_head.head.weight": "nextn.shared_head_head.weight",
          "embed_tokens.weight": "nextn.embed_tokens.weight"}
_NEXTN_REQUIRED = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_SKIP = ("self_attn.rotary_emb.inv_freq",)
_GATING_SIGMOID = 2  # llama.cpp's expert_gating_func numbering: 1 softmax, 2 sigmoid

# transformers' Glm4MoeConfig defaults: llama.cpp reads the config through transformers, so a field
# missing from config.json still reaches its GGUF with this value.
_GLM_DEFAULTS: dict[str, Any] = {"n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                 "routed_scaling_factor": 1.0, "norm_topk_prob": True}


@dataclass(frozen=True)
class _Spec:
    """The layer structure a config promises; every block is checked against it."""

    arch: str
    n_layer: int  # trunk blocks
    n_mtp: int
    n_dense: int  # leading dense blocks
    n_expert: int
    n_ff: int
    n_ff_exp: int
    hidden: int
    shared: bool
    attn_bias: bool
    qk_norm: bool

    @property
    def post_norm(self) -> str:
        """The GGUF name of the norm before the MLP, as the architecture's recipe reads it."""
        return ARCHITECTURES[self.arch].ffn_norm + ".weight"


def _spec(ckpt: HFCheckpoint, arch: str) -> _Spec:
    cfg, where = ckpt.config, ckpt.path
    expert_key = "n_routed_experts" if arch == "glm4moe" else ("num_local_experts" if "num_local_experts" in cfg
                                                                else "num_experts")
    n_expert = int(need(cfg, expert_key, where))
    n_layer = int(need(cfg, "num_hidden_layers", where))
    if arch == "qwen3moe":
        if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
            raise ModelFileError(where / "config.json", "dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                                 "are not supported for qwen3moe")
        if not cfg.get("norm_topk_prob", False):
            raise ModelFileError(where / "config.json", "norm_topk_prob false is not supported: llama.cpp's qwen3moe "
                                 "always renormalises the chosen experts' weights")
        n_mtp, n_dense, shared = 0, 0, False
        attn_bias, qk_norm = bool(cfg.get("attention_bias", False)), True
    else:
        n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        n_dense = int(_glm(cfg, "first_k_dense_replace"))
        shared = int(_glm(cfg, "n_shared_experts")) > 0
        attn_bias, qk_norm = bool(cfg.get("attention_bias", False)), bool(cfg.get("use_qk_norm", False))
        if not 0 <= n_dense <= n_layer:
            raise ModelFileError(where / "config.json", f"first_k_dense_replace {n_dense} outside [0, {n_layer}]")
    n_ff_exp = int(need(cfg, "moe_intermediate_size", where))
    return _Spec(arch, n_layer, n_mtp, n_dense, n_expert, int(need(cfg, "intermediate_size", where)), n_ff_exp,
                 int(need(cfg, "hidden_size", where)), shared, attn_bias, qk_norm)


def _recipe_moe(arch: str) -> MoERecipe:
    moe = ARCHITECTURES[arch].moe
    assert moe is not None, f"{arch} is a MoE architecture"
    return moe


def _glm(cfg: dict[str, Any], key: str) -> Any:
    return cfg[key] if cfg.get(key) is not None else _GLM_DEFAULTS[key]


def _partial_rotary(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    return float(cfg.get("partial_rotary_factor") or 0.5)


def _write_keys(out: GGUFOut, ckpt: HFCheckpoint, spec: _Spec, n_block: int, mtp: str) -> None:
    cfg, w, k = ckpt.config, out.w, out.key
    write_decoder_keys(out, cfg, n_layer=n_block, where=ckpt.path, llama_style=False,
                       head_dim_keys=bool(cfg.get("head_dim")))
    w.add_uint32(k("expert_count"), spec.n_expert)
    w.add_uint32(k("expert_used_count"), int(need(cfg, "num_experts_per_tok", ckpt.path)))
    w.add_uint32(k("expert_feed_forward_length"), spec.n_ff_exp)
    if spec.arch == "qwen3moe":
        return
    w.add_uint32(k("expert_group_count"), int(_glm(cfg, "n_group")))
    w.add_uint32(k("expert_group_used_count"), int(_glm(cfg, "topk_group")))
    w.add_uint32(k("rope.dimension_count"), int(head_dim(cfg) * _partial_rotary(cfg)))
    w.add_uint32(k("expert_shared_count"), int(_glm(cfg, "n_shared_experts")))
    w.add_uint32(k("leading_dense_block_count"), spec.n_dense)
    w.add_uint32(k("expert_gating_func"), _GATING_SIGMOID)
    w.add_float32(k("expert_weights_scale"), float(_glm(cfg, "routed_scaling_factor")))
    w.add_bool(k("expert_weights_norm"), bool(_glm(cfg, "norm_topk_prob")))
    if mtp != "drop":
        w.add_uint32(k("nextn_predict_layers"), spec.n_mtp)


def check_shape(ckpt: HFCheckpoint, name: str, shape: tuple[int, ...]) -> None:
    if ckpt.shape(name) != shape:
        raise ModelFileError(ckpt.path, f"tensor {name!r} has shape {ckpt.shape(name)}, expected {shape}")


def stacked_experts(ckpt: HFCheckpoint, prefix: str, present: set[str], *, n_expert: int, hidden: int,
                    n_ff_exp: int) -> dict[str, np.ndarray]:
    """{"gate" | "up" | "down": [n_expert, out, in]} for one block whose routed experts are stored per
    expert or fused; consumes the names (relative to ``prefix``) it reads from ``present``."""
    per_expert = {s for s in present if _EXPERT.fullmatch(s)}
    fused = {s for s in present if s in _FUSED}
    if per_expert and fused:
        raise ModelFileError(ckpt.path, f"{prefix}mlp.experts holds both per-expert and fused expert tensors")
    e, h, f = n_expert, hidden, n_ff_exp
    if fused:
        for s in _FUSED:
            if s not in fused:
                raise ModelFileError(ckpt.path, f"missing tensor {prefix + s!r}")
        check_shape(ckpt, prefix + _FUSED[0], (e, 2 * f, h))
        check_shape(ckpt, prefix + _FUSED[1], (e, h, f))
        present -= fused
        gate_up = ckpt.get(prefix + _FUSED[0])
        return {"gate": gate_up[:, :f], "up": gate_up[:, f:], "down": ckpt.get(prefix + _FUSED[1])}
    stacked: dict[str, np.ndarray] = {}
    for proj, shape in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
        mats = []
        for x in range(e):
            suffix = f"mlp.experts.{x}.{proj}_proj.weight"
            if suffix not in present:
                raise ModelFileError(ckpt.path, f"missing tensor {prefix + suffix!r} (expert {x} of {e})")
            check_shape(ckpt, prefix + suffix, shape)
            mats.append(ckpt.get(prefix + suffix))
            present.discard(suffix)
        stacked[proj] = np.stack(mats)
    return stacked


def _write_block(out: GGUFOut, ckpt: HFCheckpoint, spec: _Spec, i: int) -> None:
    """Copy block ``i`` (trunk or MTP); every tensor under its prefix must be one we know."""
    prefix, blk = f"model.layers.{i}.", f"blk.{i}."
    present = {n[len(prefix):] for n in ckpt.names() if n.startswith(prefix)} - set(_SKIP)
    required = ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight"]
    if spec.attn_bias:
        required += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if spec.qk_norm:
        required += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names = dict(ATTN_MAP)
    if i < spec.n_dense:
        required += list(_DENSE)
        names.update(_DENSE)
    else:
        required.append("mlp.gate.weight")
        names.update(_ROUTER)
        if _recipe_moe(spec.arch).selection_bias:
            required.append("mlp.gate.e_score_correction_bias")
        if spec.shared:
            required += list(_SHARED)
            names.update(_SHARED)
    if i >= spec.n_layer:
        required += list(_NEXTN_REQUIRED)
        names.update(_NEXTN)
    for suffix in required:
        if suffix not in present:
            raise ModelFileError(ckpt.path, f"missing tensor {prefix + suffix!r}")
    if i >= spec.n_dense:
        check_shape(ckpt, prefix + "mlp.gate.weight", (spec.n_expert, spec.hidden))
        for proj, data in stacked_experts(ckpt, prefix, present, n_expert=spec.n_expert, hidden=spec.hidden,
                                          n_ff_exp=spec.n_ff_exp).items():
            out.tensor(f"{blk}ffn_{proj}_exps.weight", data)
    for suffix in sorted(present):
        if suffix == "post_attention_layernorm.weight":
            out.tensor(blk + spec.post_norm, ckpt.get(prefix + suffix))
        elif suffix in names:
            # the router stays F32 at any --outtype, as llama.cpp keeps it
            out.tensor(blk + names[suffix], ckpt.get(prefix + suffix), keep_f32=suffix == "mlp.gate.weight")
        else:
            raise ModelFileError(ckpt.path, f"unexpected tensor {prefix + suffix!r} (not a {spec.arch} block weight)")


def convert_moe(ckpt: HFCheckpoint, outfile: Path, outtype: str, *, pre: str | None, mtp: str = "keep") -> Path:
    cfg = ckpt.config
    arch = MOE_ARCHS[cfg["architectures"][0]]
    spec = _spec(ckpt, arch)  # `mtp` is one of MTP_MODES: convert_hf.convert checked it
    if mtp != "keep" and arch == "qwen3moe":
        raise ConfigError("--mtp / --no-mtp: qwen3moe checkpoints have no MTP (nextn) layers")
    if mtp == "only" and spec.n_mtp == 0:
        raise ModelFileError(ckpt.path / "config.json", "--mtp: this checkpoint has no MTP (nextn) layers "
                             "(num_nextn_predict_layers is 0 or missing)")
    vocab_size = int(need(cfg, "vocab_size", ckpt.path))
    ckpt.require_tensors()
    n_total = spec.n_layer + spec.n_mtp
    beyond = [n for n in ckpt.names() if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= n_total]
    if beyond:
        raise ModelFileError(ckpt.path, f"tensors beyond num_hidden_layers + num_nextn_predict_layers = {n_total}: "
                             f"{beyond[:3]}")
    top = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    extra = [n for n in ckpt.names() if not n.startswith("model.layers.") and n not in top]
    if extra:
        raise ModelFileError(ckpt.path, f"unexpected tensors {extra[:5]}")
    blocks = {"keep": range(n_total), "drop": range(spec.n_layer), "only": range(spec.n_layer, n_total)}[mtp]

    out = GGUFOut(outfile, arch, outtype)
    try:
        out.w.add_string("general.name", ckpt.path.name)
        _write_keys(out, ckpt, spec, spec.n_layer if mtp == "drop" else n_total, mtp)
        write_vocab(out, ckpt.path, vocab_size=vocab_size, pre=pre, flavour=vocab_flavour(cfg))
        check_shape(ckpt, "model.embed_tokens.weight", (vocab_size, spec.hidden))
        out.tensor("token_embd.weight", ckpt.get("model.embed_tokens.weight"))
        out.tensor("output_norm.weight", ckpt.get("model.norm.weight"))
        tied = bool(cfg.get("tie_word_embeddings", False))
        if "lm_head.weight" in ckpt and not tied:
            out.tensor("output.weight", ckpt.get("lm_head.weight"))
        elif not tied:
            raise ModelFileError(ckpt.path, "missing tensor 'lm_head.weight' (and tie_word_embeddings is false)")
        for i in blocks:
            _write_block(out, ckpt, spec, i)
        return out.finish()
    except BaseException:
        out.abort()
        raise
