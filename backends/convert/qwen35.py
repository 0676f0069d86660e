"""Qwen3.5 checkpoints (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and the text part of their
...ForConditionalGeneration) -> qwen35 / qwen35moe GGUF, as llama.cpp's converter writes them.

Qwen3.5 interleaves gated delta-net blocks (``linear_attn``) with gated full-attention blocks
(``layer_types``). What changes on the way to GGUF:

* every RMSNorm but the delta-net's gated one stores ``w - 1`` (the model scales by ``1 + w``):
  the GGUF holds ``w + 1``;
* ``A_log`` becomes ``ssm_a = -exp(A_log)``, ``dt_bias`` is named ``ssm_dt.bias``, the conv1d kernel
  ``[channels, 1, width]`` loses its middle axis;
* the value heads are reordered from grouped by key head (``[k0: v0 v1 | k1: v0 v1]``) to tiled
  (``[k0 v0, k1 v0, k0 v1, k1 v1]``) wherever they appear (the v rows of ``in_proj_qkv`` and of the
  conv kernel, ``in_proj_z``, ``in_proj_a``/``in_proj_b``, ``A_log``, ``dt_bias``, the columns of
  ``out_proj``), so that a runtime repeats the key heads by tiling them;
* attention's ``q_proj`` (``[q | gate]`` per head) is stored unchanged as ``attn_q``;
* MoE: routed experts stacked into one [n_expert, out, in] tensor per projection, the shared
  expert as ``*_shexp`` and its gate as ``ffn_gate_inp_shexp`` (F32, like the router).

MTP layers (``mtp.layers.K``: full-attention blocks, ``mtp.fc`` / ``mtp.pre_fc_norm_*`` /
``mtp.norm`` attached to the first of them) follow the trunk as blocks ``n_layer + K``; ``mtp="drop"``
leaves them out (``--no-mtp``), ``mtp="only"`` writes the draft file of ``--mtp`` (the MTP blocks
with the trunk's embedding, final norm and head; block numbering and keys those of the whole model).
A checkpoint without MTP layers converts as with ``--no-mtp`` (llama.cpp insists on that flag).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spekula.backends.convert.gguf_writer import GGUFOut, rope_theta
from spekula.backends.convert.moe import check_shape, stacked_experts
from spekula.backends.convert.source import HFCheckpoint, merged_text_config, need
from spekula.backends.convert.vocab import vocab_flavour, write_vocab
from spekula.core.errors import ModelFileError

QWEN35_ARCHS = {"Qwen3_5ForCausalLM": "qwen35", "Qwen3_5ForConditionalGeneration": "qwen35",
                "Qwen3_5MoeForCausalLM": "qwen35moe", "Qwen3_5MoeForConditionalGeneration": "qwen35moe"}
# Written by llama.cpp when rope_parameters has no mrope_section (its loader requires the key).
_DEFAULT_MROPE_SECTION = [11, 11, 10, 0]
_SKIP = ("self_attn.rotary_emb.inv_freq",)

# HF suffix -> GGUF suffix, per block kind; "+1" marks the (1 + w) norms stored as w.
_COMMON = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight"}
_FULL = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
_LINEAR = {"linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
           "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
           "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",
           "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.norm.weight": "ssm_norm.weight",
           "linear_attn.out_proj.weight": "ssm_out.weight"}
_DENSE = {"mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}
_MOE = {"mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
        "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}
_NEXTN = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
          "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight"}
_KEEP_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")  # as llama.cpp keeps them


@dataclass(frozen=True)
class _Spec:
    """The sizes a Qwen3.5 config promises; every block is checked against them."""

    arch: str
    n_layer: int
    n_mtp: int
    recurrent: tuple[bool, ...]  # per trunk block
    hidden: int
    n_head: int
    n_kv: int
    head_dim: int
    n_ff: int  # dense FFN rows (0 for MoE)
    n_k_heads: int
    n_v_heads: int
    head_k: int
    head_v: int
    conv_kernel: int
    n_expert: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0

    @property
    def moe(self) -> bool:
        return self.arch == "qwen35moe"

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v

    def shapes(self, recurrent: bool) -> dict[str, tuple[int, ...]]:
        """HF suffix -> shape of one block's attention (or delta-net), norms and dense FFN."""
        h, out = self.hidden, {"input_layernorm.weight": (self.hidden,),
                               "post_attention_layernorm.weight": (self.hidden,)}
        if recurrent:
            conv = 2 * self.key_dim + self.value_dim
            out |= {"linear_attn.in_proj_qkv.weight": (conv, h), "linear_attn.in_proj_z.weight": (self.value_dim, h),
                    "linear_attn.in_proj_b.weight": (self.n_v_heads, h), "linear_attn.in_proj_a.weight": (self.n_v_heads, h),
                    "linear_attn.A_log": (self.n_v_heads,), "linear_attn.dt_bias": (self.n_v_heads,),
                    "linear_attn.conv1d.weight": (conv, 1, self.conv_kernel), "linear_attn.norm.weight": (self.head_v,),
                    "linear_attn.out_proj.weight": (h, self.value_dim)}
        else:
            q, kv = self.n_head * self.head_dim, self.n_kv * self.head_dim
            out |= {"self_attn.q_proj.weight": (2 * q, h), "self_attn.k_proj.weight": (kv, h),
                    "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                    "self_attn.q_norm.weight": (self.head_dim,), "self_attn.k_norm.weight": (self.head_dim,)}
        if self.moe:
            f = self.n_ff_shexp
            out |= {"mlp.gate.weight": (self.n_expert, h), "mlp.shared_expert_gate.weight": (1, h),
                    "mlp.shared_expert.gate_proj.weight": (f, h), "mlp.shared_expert.up_proj.weight": (f, h),
                    "mlp.shared_expert.down_proj.weight": (h, f)}
        else:
            out |= {"mlp.gate_proj.weight": (self.n_ff, h), "mlp.up_proj.weight": (self.n_ff, h),
                    "mlp.down_proj.weight": (h, self.n_ff)}
        return out


def _int(cfg: dict[str, Any], key: str, where: Path) -> int:
    value = need(cfg, key, where)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelFileError(where / "config.json", f"{key} must be a non-negative integer, got {value!r}")
    return value


def _layer_types(cfg: dict[str, Any], n_layer: int, where: Path) -> tuple[bool, ...]:
    """Per trunk block: recurrent (linear_attention) or not; from layer_types, else full_attention_interval."""
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        return tuple((i + 1) % interval != 0 for i in range(n_layer))
    if not isinstance(types, list) or len(types) != n_layer:
        raise ModelFileError(where / "config.json", f"layer_types must list num_hidden_layers ({n_layer}) entries")
    unknown = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if unknown:
        raise ModelFileError(where / "config.json", f"unknown layer_types {unknown} (linear_attention, full_attention)")
    return tuple(t == "linear_attention" for t in types)


def _spec(ckpt: HFCheckpoint, cfg: dict[str, Any], arch: str, mtp_layers: int) -> _Spec:
    where = ckpt.path
    n_layer = _int(cfg, "num_hidden_layers", where)
    n_head = _int(cfg, "num_attention_heads", where)
    hidden = _int(cfg, "hidden_size", where)
    n_mtp = int(cfg.get("mtp_num_hidden_layers") or 0) or mtp_layers  # llama.cpp counts mtp.layers when absent
    n_k, n_v = _int(cfg, "linear_num_key_heads", where), _int(cfg, "linear_num_value_heads", where)
    if not n_k or n_v % n_k:
        raise ModelFileError(where / "config.json", f"linear_num_value_heads {n_v} is not a multiple of "
                             f"linear_num_key_heads {n_k}")
    moe = {"n_expert": _int(cfg, "num_experts", where), "n_ff_exp": _int(cfg, "moe_intermediate_size", where),
           "n_ff_shexp": _int(cfg, "shared_expert_intermediate_size", where)} if arch == "qwen35moe" else {}
    return _Spec(arch=arch, n_layer=n_layer, n_mtp=n_mtp, recurrent=_layer_types(cfg, n_layer, where), hidden=hidden,
                 n_head=n_head, n_kv=int(cfg.get("num_key_value_heads") or n_head),
                 head_dim=int(cfg.get("head_dim") or hidden // n_head),
                 n_ff=0 if moe else _int(cfg, "intermediate_size", where), n_k_heads=n_k, n_v_heads=n_v,
                 head_k=_int(cfg, "linear_key_head_dim", where), head_v=_int(cfg, "linear_value_head_dim", where),
                 conv_kernel=_int(cfg, "linear_conv_kernel_dim", where), **moe)


def _rope_parameters(cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = str(params.get("rope_type", params.get("type", "default")) or "default")
    if kind != "default":
        raise ModelFileError(where / "config.json", f"rope type {kind!r} is not supported by this converter")
    return params


def _write_keys(out: GGUFOut, cfg: dict[str, Any], spec: _Spec, mtp: str, where: Path) -> None:
    """The keys llama.cpp's Qwen3.5 converter writes (TextModel's, the MoE sizes, the delta-net's, MTP's)."""
    w, k = out.w, out.key
    rope = _rope_parameters(cfg, where)
    n_block = spec.n_layer + (spec.n_mtp if mtp != "drop" else 0)
    w.add_uint32(k("block_count"), n_block)
    w.add_uint32(k("context_length"), int(cfg.get("max_position_embeddings", 2048)))
    w.add_uint32(k("embedding_length"), spec.hidden)
    if cfg.get("intermediate_size") is not None:
        w.add_uint32(k("feed_forward_length"), int(cfg["intermediate_size"]))
    w.add_uint32(k("attention.head_count"), spec.n_head)
    w.add_uint32(k("attention.head_count_kv"), spec.n_kv)
    section = list(rope.get("mrope_section") or _DEFAULT_MROPE_SECTION)
    w.add_array(k("rope.dimension_sections"), (section + [0] * 4)[:4])
    w.add_float32(k("rope.freq_base"), rope_theta(cfg))
    w.add_float32(k("attention.layer_norm_rms_epsilon"), float(cfg.get("rms_norm_eps", 1e-6)))
    if spec.moe:
        w.add_uint32(k("expert_count"), spec.n_expert)
        w.add_uint32(k("expert_used_count"), _int(cfg, "num_experts_per_tok", where))
    if cfg.get("head_dim") is not None:
        w.add_uint32(k("attention.key_length"), spec.head_dim)
        w.add_uint32(k("attention.value_length"), spec.head_dim)
    if spec.moe:
        w.add_uint32(k("expert_feed_forward_length"), spec.n_ff_exp)
        w.add_uint32(k("expert_shared_feed_forward_length"), spec.n_ff_shexp)
    if mtp != "drop" and spec.n_mtp:
        w.add_uint32(k("nextn_predict_layers"), spec.n_mtp)
    w.add_uint32(k("ssm.conv_kernel"), spec.conv_kernel)
    w.add_uint32(k("ssm.state_size"), spec.head_k)
    w.add_uint32(k("ssm.group_count"), spec.n_k_heads)
    w.add_uint32(k("ssm.time_step_rank"), spec.n_v_heads)
    w.add_uint32(k("ssm.inner_size"), spec.value_dim)
    if cfg.get("layer_types") is not None:
        w.add_array(k("attention.recurrent_layers"), [*spec.recurrent, *[False] * (n_block - spec.n_layer)])
    w.add_uint32(k("full_attention_interval"), int(cfg.get("full_attention_interval", 4)))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    w.add_uint32(k("rope.dimension_count"), int(spec.head_dim * float(partial)))


def tile_v_heads(x: np.ndarray, axis: int, n_k_heads: int, n_v_heads: int, head_dim: int) -> np.ndarray:
    """Reorder the value heads along `axis` from grouped by key head to tiled (see the module docstring)."""
    moved = np.moveaxis(x, axis, 0)
    shape = moved.shape
    tiled = moved.reshape(n_k_heads, n_v_heads // n_k_heads, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(tiled, 0, axis)


def _linear_tensor(spec: _Spec, suffix: str, data: np.ndarray) -> np.ndarray:
    """A delta-net tensor as the GGUF holds it: value heads tiled, A_log -> -exp, conv kernel squeezed."""
    n_k, n_v, tile = spec.n_k_heads, spec.n_v_heads, tile_v_heads
    if suffix == "linear_attn.in_proj_qkv.weight" or suffix == "linear_attn.conv1d.weight":
        if suffix.endswith("conv1d.weight"):
            data = data[:, 0, :]
        qk = 2 * spec.key_dim
        return np.concatenate([data[:qk], tile(data[qk:], 0, n_k, n_v, spec.head_v)])
    if suffix == "linear_attn.in_proj_z.weight":
        return tile(data, 0, n_k, n_v, spec.head_v)
    if suffix in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.dt_bias"):
        return tile(data, 0, n_k, n_v, 1)
    if suffix == "linear_attn.A_log":
        # exp in float64, rounded once to float32: the nearest float32 to -exp(A_log)
        return -np.exp(tile(data, 0, n_k, n_v, 1).astype(np.float64))
    if suffix == "linear_attn.out_proj.weight":
        return tile(data, 1, n_k, n_v, spec.head_v)
    return data


def _write_block(out: GGUFOut, ckpt: HFCheckpoint, spec: _Spec, src: str, i: int, *, recurrent: bool,
                 nextn: str | None) -> None:
    """Copy one block from HF prefix `src` to ``blk.{i}``; `nextn` is the prefix of the MTP head tensors
    (``mtp.``) for the first MTP block. Every tensor under `src` must be one this block has."""
    blk = f"blk.{i}."
    present = {n[len(src):] for n in ckpt.names() if n.startswith(src)} - set(_SKIP)
    shapes = spec.shapes(recurrent)
    for suffix, shape in shapes.items():
        if suffix not in present:
            raise ModelFileError(ckpt.path, f"missing tensor {src + suffix!r}")
        check_shape(ckpt, src + suffix, shape)
    names = {**_COMMON, **(_LINEAR if recurrent else _FULL), **(_MOE if spec.moe else _DENSE)}
    if spec.moe:
        present.discard("mlp.gate.weight")
        out.tensor(blk + "ffn_gate_inp.weight", ckpt.get(src + "mlp.gate.weight"), keep_f32=True)
        experts = stacked_experts(ckpt, src, present, n_expert=spec.n_expert, hidden=spec.hidden,
                                  n_ff_exp=spec.n_ff_exp)
        for proj, data in experts.items():
            out.tensor(f"{blk}ffn_{proj}_exps.weight", data)
    for suffix in sorted(present):
        if suffix not in names:
            kind = "gated delta-net" if recurrent else "full-attention"
            raise ModelFileError(ckpt.path, f"unexpected tensor {src + suffix!r} (not a {spec.arch} {kind} block weight)")
        data = ckpt.get(src + suffix)
        if recurrent:
            data = _linear_tensor(spec, suffix, data)
        if suffix.endswith("norm.weight") and suffix != "linear_attn.norm.weight":
            data = data + np.float32(1.0)
        out.tensor(blk + names[suffix], data, keep_f32=names[suffix] in _KEEP_F32)
    if nextn is not None:
        for suffix, name in _NEXTN.items():
            if nextn + suffix not in ckpt:
                raise ModelFileError(ckpt.path, f"missing tensor {nextn + suffix!r}")
            data = ckpt.get(nextn + suffix)
            check_shape(ckpt, nextn + suffix, (spec.hidden, 2 * spec.hidden) if suffix == "fc.weight" else (spec.hidden,))
            out.tensor(blk + name, data if suffix == "fc.weight" else data + np.float32(1.0))  # (1 + w) norms


def _mtp_layers(ckpt: HFCheckpoint) -> tuple[str, int]:
    """The prefix of the MTP tensors (``mtp.`` or ``model.mtp.``) and how many ``mtp.layers.K`` there are."""
    prefix = "model.mtp." if any(n.startswith("model.mtp.") for n in ckpt.names()) else "mtp."
    ids = {int(m.group(1)) for n in ckpt.names() if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.", n))}
    return prefix, max(ids) + 1 if ids else 0


def convert_qwen35(ckpt: HFCheckpoint, outfile: Path, outtype: str, *, pre: str | None, mtp: str = "keep") -> Path:
    raw = ckpt.config
    arch = QWEN35_ARCHS[raw["architectures"][0]]
    cfg = merged_text_config(raw)
    multimodal = raw["architectures"][0].endswith("ForConditionalGeneration")
    names = ckpt.names()
    lm = "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
    mtp_prefix, mtp_layers = _mtp_layers(ckpt)
    spec = _spec(ckpt, cfg, arch, mtp_layers)
    if mtp == "only" and spec.n_mtp == 0:
        raise ModelFileError(ckpt.path / "config.json", "--mtp: this checkpoint has no MTP layers "
                             "(mtp_num_hidden_layers is 0 or missing and there are no mtp.layers tensors)")
    if mtp_layers > spec.n_mtp:
        raise ModelFileError(ckpt.path, f"tensors of MTP layer {mtp_layers - 1} beyond mtp_num_hidden_layers "
                             f"= {spec.n_mtp}")
    vocab_size = int(need(cfg, "vocab_size", ckpt.path))
    ckpt.require_tensors()
    trunk = re.compile(re.escape(lm) + r"layers\.(\d+)\.")
    beyond = [n for n in names if (m := trunk.match(n)) and int(m.group(1)) >= spec.n_layer]
    if beyond:
        raise ModelFileError(ckpt.path, f"tensors beyond num_hidden_layers = {spec.n_layer}: {beyond[:3]}")
    top = {lm + "embed_tokens.weight", lm + "norm.weight", "lm_head.weight"}
    extra = [n for n in names if not n.startswith((lm + "layers.", mtp_prefix)) and n not in top
             and not (multimodal and n.startswith("model.visual."))]  # the vision tower is not converted
    extra += [n for n in names if n.startswith(mtp_prefix) and not n.startswith(mtp_prefix + "layers.")
              and n[len(mtp_prefix):] not in _NEXTN]
    if extra:
        raise ModelFileError(ckpt.path, f"unexpected tensors {extra[:5]}")

    out = GGUFOut(outfile, arch, outtype)
    try:
        out.w.add_string("general.name", ckpt.path.name)
        _write_keys(out, cfg, spec, mtp, ckpt.path)
        write_vocab(out, ckpt.path, vocab_size=vocab_size, pre=pre, flavour=vocab_flavour(raw))
        check_shape(ckpt, lm + "embed_tokens.weight", (vocab_size, spec.hidden))
        out.tensor("token_embd.weight", ckpt.get(lm + "embed_tokens.weight"))
        check_shape(ckpt, lm + "norm.weight", (spec.hidden,))
        out.tensor("output_norm.weight", ckpt.get(lm + "norm.weight") + np.float32(1.0))
        tied = bool(cfg.get("tie_word_embeddings", False))
        if "lm_head.weight" in ckpt and not tied:
            check_shape(ckpt, "lm_head.weight", (vocab_size, spec.hidden))
            out.tensor("output.weight", ckpt.get("lm_head.weight"))
        elif not tied:
            raise ModelFileError(ckpt.path, "missing tensor 'lm_head.weight' (and tie_word_embeddings is false)")
        if mtp != "only":
            for i in range(spec.n_layer):
                _write_block(out, ckpt, spec, f"{lm}layers.{i}.", i, recurrent=spec.recurrent[i], nextn=None)
        if mtp != "drop":
            for k in range(spec.n_mtp):
                _write_block(out, ckpt, spec, f"{mtp_prefix}layers.{k}.", spec.n_layer + k, recurrent=False,
                             nextn=mtp_prefix if k == 0 else None)
        return out.finish()
    except BaseException:
        out.abort()
        raise

