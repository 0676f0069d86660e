"""`spekula convert` for Qwen3.5: the transforms on the way to GGUF (checked against the checkpoint
itself, independently of llama.cpp), the MTP modes, other stored layouts, and clear errors."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from checkpoint_edits import edit_config, edit_tensors, nest_as_conditional_generation
from safetensors.numpy import load_file, save_file

from spekula.backends.convert.hf import convert
from spekula.backends.convert.qwen35 import tile_v_heads
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures import tiny_qwen35

D = tiny_qwen35.LINEAR_HEAD_DIM
KEY_DIM = tiny_qwen35.N_K_HEADS * D


def _copy(tmp: Path, *, moe: bool = False, n_mtp: int = 1) -> Path:
    dst = tmp / "hf"
    shutil.copytree(tiny_qwen35.tiny_qwen35_hf_path(moe=moe, n_mtp=n_mtp), dst)
    return dst


def _tensor(f: GGUFFile, name: str) -> np.ndarray:
    return np.asarray(f.tensor(name).data)


def test_value_heads_go_from_grouped_to_tiled() -> None:
    # 2 key heads with 2 value heads each: grouped [k0v0, k0v1, k1v0, k1v1] -> tiled [k0v0, k1v0, k0v1, k1v1]
    heads = np.repeat(np.arange(4), 3)  # 4 heads of 3 rows, row value = grouped head index
    np.testing.assert_array_equal(tile_v_heads(heads, 0, 2, 4, 3), np.repeat([0, 2, 1, 3], 3))
    cols = np.tile(np.repeat(np.arange(4), 3), (2, 1))
    np.testing.assert_array_equal(tile_v_heads(cols, 1, 2, 4, 3)[1], np.repeat([0, 2, 1, 3], 3))


def test_delta_net_and_attention_tensors_are_transformed_as_the_runtime_reads_them(tmp_path: Path) -> None:
    hf = tiny_qwen35.tiny_qwen35_hf_path(n_mtp=1)
    t = load_file(str(hf / "model.safetensors"))
    f = GGUFFile(convert(hf, tmp_path / "m.gguf", outtype="f32")[1])
    order = [0, 2, 1, 3]  # the tiled order of the fixture's 4 value heads (2 per key head)

    def heads(x: np.ndarray, size: int) -> np.ndarray:
        return np.concatenate([x[h * size:(h + 1) * size] for h in order])

    p = "model.layers.0.linear_attn."
    qkv = t[p + "in_proj_qkv.weight"]
    np.testing.assert_array_equal(_tensor(f, "blk.0.attn_qkv.weight"),
                                  np.concatenate([qkv[:2 * KEY_DIM], heads(qkv[2 * KEY_DIM:], D)]))
    conv = t[p + "conv1d.weight"][:, 0, :]
    np.testing.assert_array_equal(_tensor(f, "blk.0.ssm_conv1d.weight"),
                                  np.concatenate([conv[:2 * KEY_DIM], heads(conv[2 * KEY_DIM:], D)]))
    np.testing.assert_array_equal(_tensor(f, "blk.0.attn_gate.weight"), heads(t[p + "in_proj_z.weight"], D))
    np.testing.assert_array_equal(_tensor(f, "blk.0.ssm_alpha.weight"), heads(t[p + "in_proj_a.weight"], 1))
    np.testing.assert_array_equal(_tensor(f, "blk.0.ssm_beta.weight"), heads(t[p + "in_proj_b.weight"], 1))
    np.testing.assert_array_equal(_tensor(f, "blk.0.ssm_dt.bias"), heads(t[p + "dt_bias"], 1))
    np.testing.assert_array_equal(_tensor(f, "blk.0.ssm_a"),
                                  (-np.exp(heads(t[p + "A_log"], 1).astype(np.float64))).astype(np.float32))
    np.testing.assert_array_equal(_tensor(f, "blk.0.ssm_out.weight"), heads(t[p + "out_proj.weight"].T, D).T)
    np.testing.assert_array_equal(_tensor(f, "blk.0.ssm_norm.weight"), t[p + "norm.weight"])  # a plain-scale norm
    for gguf_name, hf_name in (("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                               ("blk.1.post_attention_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
                               ("blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"),
                               ("output_norm.weight", "model.norm.weight"),
                               ("blk.4.nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
                               ("blk.4.nextn.shared_head_norm.weight", "mtp.norm.weight")):
        np.testing.assert_array_equal(_tensor(f, gguf_name), t[hf_name] + np.float32(1))  # (1 + w) norms
    # attention's q_proj ([q | gate] per head) and the MTP block's are copied as they are
    np.testing.assert_array_equal(_tensor(f, "blk.1.attn_q.weight"), t["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(_tensor(f, "blk.4.attn_q.weight"), t["mtp.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(_tensor(f, "blk.4.nextn.eh_proj.weight"), t["mtp.fc.weight"])
    assert f.get("qwen35.attention.recurrent_layers") == [True, False, True, False, False]


def test_moe_experts_shared_expert_and_its_gate(tmp_path: Path) -> None:
    hf = tiny_qwen35.tiny_qwen35_hf_path(moe=True, n_mtp=1, seed=1)
    t = load_file(str(hf / "model.safetensors"))
    f = GGUFFile(convert(hf, tmp_path / "m.gguf", outtype="q8_0")[1])
    p = "model.layers.2.mlp."
    for proj in ("gate", "up", "down"):
        assert f.tensor(f"blk.2.ffn_{proj}_exps.weight").type_name == "Q8_0"
    # router and shared-expert gate stay F32 at any outtype, as llama.cpp keeps them
    np.testing.assert_array_equal(_tensor(f, "blk.2.ffn_gate_inp.weight"), t[p + "gate.weight"])
    np.testing.assert_array_equal(_tensor(f, "blk.2.ffn_gate_inp_shexp.weight"), t[p + "shared_expert_gate.weight"])
    assert f.tensor("blk.0.ssm_conv1d.weight").type_name == "F32"
    assert f.get("qwen35moe.expert_shared_feed_forward_length") == 32 and f.get("qwen35moe.feed_forward_length") is None


def test_fused_experts_convert_like_per_expert_ones(tmp_path: Path) -> None:
    hf = _copy(tmp_path, moe=True)
    per_expert = GGUFFile(convert(hf, tmp_path / "a.gguf", outtype="f32")[1])
    t = load_file(str(hf / "model.safetensors"))
    for prefix in [f"model.layers.{i}.mlp." for i in range(4)] + ["mtp.layers.0.mlp."]:
        def stack(proj: str, prefix: str = prefix) -> np.ndarray:
            return np.stack([t.pop(f"{prefix}experts.{e}.{proj}_proj.weight") for e in range(tiny_qwen35.N_EXPERT)])
        t[prefix + "experts.gate_up_proj"] = np.concatenate([stack("gate"), stack("up")], axis=1)
        t[prefix + "experts.down_proj"] = stack("down")
    save_file(t, str(hf / "model.safetensors"))
    fused = GGUFFile(convert(hf, tmp_path / "b.gguf", outtype="f32")[1])
    assert fused.tensor_names() == per_expert.tensor_names()
    for name in per_expert.tensor_names():
        np.testing.assert_array_equal(_tensor(fused, name), _tensor(per_expert, name), err_msg=name)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_multimodal_layout_converts_its_text_part_to_the_same_file(moe: bool, tmp_path: Path) -> None:
    hf = _copy(tmp_path, moe=moe)
    text = GGUFFile(convert(hf, tmp_path / "text.gguf", outtype="f32")[1])
    nest_as_conditional_generation(hf)
    assert json.loads((hf / "config.json").read_text())["architectures"][0].endswith("ForConditionalGeneration")
    vl = GGUFFile(convert(hf, tmp_path / "vl.gguf", outtype="f32")[1])
    assert {k: v for k, v in vl.metadata.items() if k != "general.name"} == \
        {k: v for k, v in text.metadata.items() if k != "general.name"}
    assert vl.tensor_names() == text.tensor_names()
    for name in text.tensor_names():
        np.testing.assert_array_equal(_tensor(vl, name), _tensor(text, name), err_msg=name)


def test_mtp_modes_split_the_model(tmp_path: Path) -> None:
    hf = tiny_qwen35.tiny_qwen35_hf_path(n_mtp=2)
    files = {mode: GGUFFile(convert(hf, tmp_path / f"{mode}.gguf", outtype="f32", mtp=mode)[1])
             for mode in ("keep", "drop", "only")}
    assert [files[m].get("qwen35.block_count") for m in ("keep", "drop", "only")] == [6, 4, 6]
    assert [files[m].get("qwen35.nextn_predict_layers") for m in ("keep", "drop", "only")] == [2, None, 2]
    assert files["drop"].get("qwen35.attention.recurrent_layers") == [True, False, True, False]
    only = set(files["only"].tensor_names())
    assert {n.split(".")[1] for n in only if n.startswith("blk.")} == {"4", "5"}
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= only
    # the MTP head's own tensors belong to the first MTP block; the second is a decoder block only
    assert "blk.4.nextn.eh_proj.weight" in only and not any(n.startswith("blk.5.nextn.") for n in only)
    assert set(files["keep"].tensor_names()) == set(files["drop"].tensor_names()) | only


def test_mtp_only_needs_mtp_layers_and_without_them_keep_writes_the_trunk(tmp_path: Path) -> None:
    hf = tiny_qwen35.tiny_qwen35_hf_path(n_mtp=0)
    with pytest.raises(ModelFileError, match="--mtp: this checkpoint has no MTP layers"):
        convert(hf, tmp_path / "o.gguf", outtype="f32", mtp="only")
    f = GGUFFile(convert(hf, tmp_path / "k.gguf", outtype="f32")[1])
    assert f.get("qwen35.block_count") == 4 and f.get("qwen35.nextn_predict_layers") is None


def test_tied_head_writes_no_output_tensor(tmp_path: Path) -> None:
    hf = _copy(tmp_path)
    edit_config(hf, tie_word_embeddings=True)
    edit_tensors(hf, drop=("lm_head.weight",))
    f = GGUFFile(convert(hf, tmp_path / "t.gguf", outtype="f32")[1])
    assert not f.has_tensor("output.weight") and f.has_tensor("token_embd.weight")


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda hf: edit_tensors(hf, drop=("model.layers.0.linear_attn.A_log",)),
     "missing tensor 'model.layers.0.linear_attn.A_log'"),
    (lambda hf: edit_tensors(hf, **{"model.layers.1.linear_attn.A_log": np.zeros(4, np.float32)}),
     "unexpected tensor 'model.layers.1.linear_attn.A_log' (not a qwen35 full-attention block weight)"),
    (lambda hf: edit_tensors(hf, **{"model.layers.2.linear_attn.in_proj_qkv.weight": np.zeros((96, 64), np.float32)}),
     "tensor 'model.layers.2.linear_attn.in_proj_qkv.weight' has shape (96, 64), expected (128, 64)"),
    (lambda hf: edit_tensors(hf, drop=("mtp.fc.weight",)), "missing tensor 'mtp.fc.weight'"),
    (lambda hf: edit_tensors(hf, **{"mtp.extra.weight": np.zeros(4, np.float32)}), "unexpected tensors ['mtp.extra.weight']"),
    (lambda hf: edit_tensors(hf, **{"mtp.layers.3.input_layernorm.weight": np.zeros(64, np.float32)}),
     "tensors of MTP layer 3 beyond mtp_num_hidden_layers = 1"),
    (lambda hf: edit_tensors(hf, **{"model.layers.4.input_layernorm.weight": np.zeros(64, np.float32)}),
     "tensors beyond num_hidden_layers = 4"),
    (lambda hf: edit_config(hf, layer_types=["linear_attention", "full_attention"]), "layer_types must list"),
    (lambda hf: edit_config(hf, linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple"),
    (lambda hf: edit_config(hf, rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
])
def test_bad_checkpoints_are_named(edit: Callable[[Path], None], needle: str, tmp_path: Path) -> None:
    hf = _copy(tmp_path)
    edit(hf)
    with pytest.raises(ModelFileError, match=re.escape(needle)):
        convert(hf, tmp_path / "bad.gguf", outtype="f32")
    assert not (tmp_path / "bad.gguf").exists()
