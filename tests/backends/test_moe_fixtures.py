"""The tiny MoE checkpoints load in transformers as the published ones do (per-expert tensors fused on load)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from spekula.fixtures import tiny_moe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_qwen3moe_loads_with_no_missing_or_unexpected_keys(tmp_path: Path) -> None:
    hf = tiny_moe.write_qwen3moe(tmp_path / "q")
    model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(hf, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    logits = model(torch.tensor([[5, 17, 99, 200]])).logits
    assert logits.shape == (1, 4, tiny_moe.VOCAB) and torch.isfinite(logits).all()


def test_glm4moe_trunk_loads_and_mtp_layers_are_the_only_leftovers(tmp_path: Path) -> None:
    hf = tiny_moe.write_glm4moe(tmp_path / "g", n_mtp=1, qk_norm=True)
    model, info = transformers.Glm4MoeForCausalLM.from_pretrained(hf, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    assert float(model.config.routed_scaling_factor) == 2.5
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    assert tok.get_added_vocab()["[gMASK]"] == tiny_moe.glm_token_id("[gMASK]")


def test_copy_last_block_copies_the_decoder_block_only(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    t = load_file(str(tiny_moe.write_glm4moe(tmp_path / "g", n_mtp=2, copy_last_block=True) / "model.safetensors"))
    for k in (3, 4):
        np.testing.assert_array_equal(t[f"model.layers.{k}.mlp.experts.1.up_proj.weight"],
                                      t["model.layers.2.mlp.experts.1.up_proj.weight"])
        np.testing.assert_array_equal(t[f"model.layers.{k}.shared_head.norm.weight"], t["model.norm.weight"])
    assert not np.array_equal(t["model.layers.3.eh_proj.weight"], t["model.layers.4.eh_proj.weight"])
