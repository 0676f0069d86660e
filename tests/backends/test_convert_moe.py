"""`spekula convert` for MoE targets: stacked experts, GLM's MTP (nextn) blocks, --mtp / --no-mtp, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from checkpoint_edits import edit_config, edit_tensors
from safetensors.numpy import load_file, save_file

from spekula.backends.convert.hf import convert
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures import tiny_hf, tiny_moe
from spekula.frontends.cli.main import main as cli_main


def _stacked(hf: dict[str, np.ndarray], layer: int, proj: str) -> np.ndarray:
    return np.stack([hf[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(tiny_moe.N_EXPERT)])


def test_qwen3moe_names_keys_and_stacked_experts(tmp_path: Path) -> None:
    hf = tiny_moe.write_qwen3moe(tmp_path / "hf", n_layer=2)
    out = tmp_path / "m.gguf"
    assert convert(hf, out, outtype="f16") == ("moe", out)
    f, t = GGUFFile(out), load_file(str(hf / "model.safetensors"))
    assert f.architecture == "qwen3moe"
    assert (f.get("qwen3moe.expert_count"), f.get("qwen3moe.expert_used_count")) == (4, 2)
    assert f.get("qwen3moe.expert_feed_forward_length") == 32 and f.get("qwen3moe.block_count") == 2
    gate = f.tensor("blk.1.ffn_gate_exps.weight")
    assert gate.shape == (4, 32, 64) and gate.type_name == "F16"
    np.testing.assert_array_equal(gate.data, _stacked(t, 1, "gate").astype(np.float16))
    assert f.tensor("blk.1.ffn_down_exps.weight").shape == (4, 64, 32)
    router = f.tensor("blk.1.ffn_gate_inp.weight")  # the router stays F32 in an f16 file
    assert router.type_name == "F32"
    np.testing.assert_array_equal(router.data, t["model.layers.1.mlp.gate.weight"])
    assert f.has_tensor("blk.0.ffn_norm.weight") and f.has_tensor("blk.0.attn_q_norm.weight")
    assert f.has_tensor("output.weight") and not f.has_tensor("blk.0.ffn_gate.weight")


def test_glm4moe_dense_lead_shared_expert_bias_and_nextn(tmp_path: Path) -> None:
    hf = tiny_moe.write_glm4moe(tmp_path / "hf", n_mtp=1)
    out = tmp_path / "m.gguf"
    convert(hf, out, outtype="f32")
    f, t = GGUFFile(out), load_file(str(hf / "model.safetensors"))
    k = "glm4moe."
    assert f.get(k + "block_count") == 4 and f.get(k + "nextn_predict_layers") == 1
    assert f.get(k + "leading_dense_block_count") == 1 and f.get(k + "expert_shared_count") == 1
    assert f.get(k + "rope.dimension_count") == 8  # partial rotary: half of head_dim 16
    assert f.get(k + "expert_gating_func") == 2 and f.get(k + "expert_weights_norm") is True
    assert f.get(k + "expert_weights_scale") == pytest.approx(2.5)
    assert f.has_tensor("blk.0.ffn_gate.weight") and not f.has_tensor("blk.0.ffn_gate_exps.weight")
    assert f.has_tensor("blk.1.post_attention_norm.weight") and not f.has_tensor("blk.1.ffn_norm.weight")
    np.testing.assert_array_equal(f.tensor("blk.2.exp_probs_b.bias").data,
                                  t["model.layers.2.mlp.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(f.tensor("blk.2.ffn_up_shexp.weight").data,
                                  t["model.layers.2.mlp.shared_experts.up_proj.weight"])
    np.testing.assert_array_equal(f.tensor("blk.3.ffn_up_exps.weight").data, _stacked(t, 3, "up"))
    np.testing.assert_array_equal(f.tensor("blk.3.nextn.eh_proj.weight").data, t["model.layers.3.eh_proj.weight"])
    for name in ("enorm", "hnorm", "shared_head_norm", "shared_head_head", "embed_tokens"):
        assert f.has_tensor(f"blk.3.nextn.{name}.weight"), name
    # GLM's vocabulary roles
    assert f.get("tokenizer.ggml.bos_token_id") == tiny_moe.glm_token_id("[gMASK]")
    assert f.get("tokenizer.ggml.eom_token_id") == tiny_moe.glm_token_id("<|observation|>")


def test_no_mtp_and_mtp_only_split_the_model(tmp_path: Path) -> None:
    hf = tiny_moe.write_glm4moe(tmp_path / "hf", n_mtp=2)
    convert(hf, tmp_path / "full.gguf", outtype="f32")
    convert(hf, tmp_path / "trunk.gguf", outtype="f32", mtp="drop")
    convert(hf, tmp_path / "mtp.gguf", outtype="f32", mtp="only")
    full, trunk, mtp = (GGUFFile(tmp_path / n) for n in ("full.gguf", "trunk.gguf", "mtp.gguf"))
    assert trunk.get("glm4moe.block_count") == 3 and trunk.get("glm4moe.nextn_predict_layers") is None
    assert not any(n.startswith(("blk.3.", "blk.4.")) for n in trunk.tensor_names())
    # the draft keeps the whole model's numbering and keys, and only the blocks after the trunk
    assert mtp.get("glm4moe.block_count") == 5 and mtp.get("glm4moe.nextn_predict_layers") == 2
    blocks = {n.split(".")[1] for n in mtp.tensor_names() if n.startswith("blk.")}
    assert blocks == {"3", "4"}
    assert {n for n in mtp.tensor_names() if not n.startswith("blk.")} == {
        "token_embd.weight", "output_norm.weight", "output.weight"}
    assert set(trunk.tensor_names()) | set(mtp.tensor_names()) == set(full.tensor_names())
    for name in mtp.tensor_names():
        np.testing.assert_array_equal(mtp.tensor(name).data, full.tensor(name).data, err_msg=name)


def test_fused_expert_tensors_convert_like_per_expert_ones(tmp_path: Path) -> None:
    """transformers 5 keeps experts fused (gate_up_proj [E, 2*ff, H], down_proj [E, H, ff]); both layouts give one file."""
    hf = tiny_moe.write_qwen3moe(tmp_path / "hf", n_layer=2)
    convert(hf, tmp_path / "a.gguf", outtype="f32")
    t = load_file(str(hf / "model.safetensors"))
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        gate, up, down = (_stacked(t, i, proj) for proj in ("gate", "up", "down"))
        for name in [n for n in t if n.startswith(p)]:
            del t[name]
        t[p + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
        t[p + "down_proj"] = down
    save_file(t, str(hf / "model.safetensors"))
    convert(hf, tmp_path / "b.gguf", outtype="f32")
    a, b = GGUFFile(tmp_path / "a.gguf"), GGUFFile(tmp_path / "b.gguf")
    assert set(a.tensor_names()) == set(b.tensor_names())
    for name in a.tensor_names():
        np.testing.assert_array_equal(a.tensor(name).data, b.tensor(name).data, err_msg=name)


def test_missing_or_unexpected_tensors_are_named(tmp_path: Path) -> None:
    hf = tiny_moe.write_glm4moe(tmp_path / "hf", n_mtp=1)
    gone = "model.layers.2.mlp.experts.3.up_proj.weight"
    edit_tensors(hf, drop=(gone,))
    with pytest.raises(ModelFileError, match=f"missing tensor '{gone}'"):
        convert(hf, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    hf = tiny_moe.write_glm4moe(tmp_path / "hf2", n_mtp=1)
    edit_tensors(hf, drop=("model.layers.3.eh_proj.weight",))
    with pytest.raises(ModelFileError, match="missing tensor 'model.layers.3.eh_proj.weight'"):
        convert(hf, tmp_path / "x.gguf")
    hf = tiny_moe.write_glm4moe(tmp_path / "hf3")
    edit_tensors(hf, **{"model.layers.1.mlp.experts.4.up_proj.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(ModelFileError, match="unexpected tensor 'model.layers.1.mlp.experts.4.up_proj.weight'"):
        convert(hf, tmp_path / "x.gguf")
    hf = tiny_moe.write_glm4moe(tmp_path / "hf4", n_mtp=1)
    edit_config(hf, num_nextn_predict_layers=0)
    with pytest.raises(ModelFileError, match="beyond num_hidden_layers"):
        convert(hf, tmp_path / "x.gguf")
    hf = tiny_moe.write_qwen3moe(tmp_path / "hf5", n_layer=1)
    edit_tensors(hf, **{"model.layers.0.mlp.gate.weight": np.zeros((3, 64), np.float32)})
    with pytest.raises(ModelFileError, match=r"mlp.gate.weight' has shape \(3, 64\), expected \(4, 64\)"):
        convert(hf, tmp_path / "x.gguf")


def test_mtp_flags_need_mtp_layers(tmp_path: Path) -> None:
    glm = tiny_moe.write_glm4moe(tmp_path / "glm")  # num_nextn_predict_layers 0
    with pytest.raises(ModelFileError, match="no MTP"):
        convert(glm, tmp_path / "x.gguf", mtp="only")
    convert(glm, tmp_path / "trunk.gguf", mtp="drop")  # nothing to drop is fine
    qwen = tiny_moe.write_qwen3moe(tmp_path / "qwen", n_layer=1)
    with pytest.raises(ConfigError, match="qwen3moe checkpoints have no MTP"):
        convert(qwen, tmp_path / "x.gguf", mtp="drop")
    llama = tiny_hf.write_target(tmp_path / "llama", "llama", n_layer=1)
    with pytest.raises(ConfigError, match="--mtp / --no-mtp apply to"):
        convert(llama, tmp_path / "x.gguf", mtp="only")
    assert not (tmp_path / "x.gguf").exists()


def test_qwen3moe_settings_the_graph_cannot_express_are_refused(tmp_path: Path) -> None:
    hf = tiny_moe.write_qwen3moe(tmp_path / "hf", n_layer=1)
    edit_config(hf, norm_topk_prob=False)
    with pytest.raises(ModelFileError, match="norm_topk_prob"):
        convert(hf, tmp_path / "x.gguf")
    edit_config(hf, norm_topk_prob=True, mlp_only_layers=[0])
    with pytest.raises(ModelFileError, match="mlp_only_layers"):
        convert(hf, tmp_path / "x.gguf")


def test_cli_help_lists_mtp_flags_and_they_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["convert", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "--mtp" in help_text and "--no-mtp" in help_text and "GLM-4.5-MoE" in help_text
    hf = tiny_moe.write_glm4moe(tmp_path / "hf", n_mtp=1)
    assert cli_main(["convert", str(hf), "--mtp", "--outtype", "f32", "--outfile", str(tmp_path / "d.gguf")]) == 0
    assert GGUFFile(tmp_path / "d.gguf").has_tensor("blk.3.nextn.eh_proj.weight")
    with pytest.raises(SystemExit) as exc:
        cli_main(["convert", str(hf), "--mtp", "--no-mtp", "--outfile", str(tmp_path / "x.gguf")])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    glm0 = tiny_moe.write_glm4moe(tmp_path / "glm0")
    rc = cli_main(["convert", str(glm0), "--mtp", "--outfile", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert rc == 1 and "spekula: error:" in err and "no MTP" in err and "Traceback" not in err


def test_moe_gguf_fixture_variants(tmp_path: Path) -> None:
    full = GGUFFile(tiny_moe.tiny_moe_gguf_path("glm4moe", n_mtp=1))
    draft = GGUFFile(tiny_moe.tiny_moe_gguf_path("glm4moe", n_mtp=1, variant="mtp_only"))
    assert full.get("glm4moe.block_count") == 4 and draft.has_tensor("blk.3.nextn.enorm.weight")
    assert not draft.has_tensor("blk.0.attn_norm.weight")
    assert GGUFFile(tiny_moe.tiny_moe_gguf_path("qwen3moe")).architecture == "qwen3moe"
    with pytest.raises(ValueError, match="needs n_mtp"):
        tiny_moe.tiny_moe_gguf_path("glm4moe", variant="mtp_only")
