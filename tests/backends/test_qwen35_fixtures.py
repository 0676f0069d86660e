"""The tiny Qwen3.5 fixtures: transformers loads and runs the checkpoints (the MTP tensors aside), no
weight that a path depends on is trivial, and every GGUF variant reads as the config says; a hybrid
file with a missing delta-net key or inconsistent recurrent-block flags is refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.recipes import FEATURES
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures import tiny_qwen35
from spekula.fixtures.tiny_gguf import write_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = [5, 17, 99, 200, 3, 250, 64, 12]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_checkpoint_loads_and_runs_in_transformers(moe: bool) -> None:
    hf = tiny_qwen35.tiny_qwen35_hf_path(moe=moe, n_mtp=1)
    cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    model, info = cls.from_pretrained(hf, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    names = load_file(str(hf / "model.safetensors"))
    leftovers = {n for n in names if not n.startswith(("model.", "lm_head."))}
    assert leftovers and all(n.startswith("mtp.") for n in leftovers)  # transformers ignores them by design
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0]
    assert logits.shape == (len(TOKENS), tiny_qwen35.VOCAB) and torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) > 1  # the prediction depends on the context
    assert logits.std() > 0.5  # weights large enough that logits are not near-uniform


def test_config_is_the_promised_shape() -> None:
    cfg = json.loads((tiny_qwen35.tiny_qwen35_hf_path(moe=True, n_mtp=2) / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["mtp_num_hidden_layers"] == 2
    assert cfg["layer_types"] == list(tiny_qwen35.LAYER_TYPES) and cfg["full_attention_interval"] == 2
    assert cfg["linear_num_value_heads"] == 2 * cfg["linear_num_key_heads"]
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert 2 * sum(cfg["rope_parameters"]["mrope_section"]) == cfg["head_dim"] // 4
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["shared_expert_intermediate_size"]) == (4, 2, 32)


def test_weights_that_paths_depend_on_are_not_trivial() -> None:
    t = load_file(str(tiny_qwen35.tiny_qwen35_hf_path(n_mtp=1) / "model.safetensors"))
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_norm.weight", "model.norm.weight",
                 "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.post_attention_layernorm.weight"):
        assert np.abs(t[name]).max() > 0.05, name  # (1 + w) norms: transformers initialises w to zeros
    for name in ("model.layers.0.linear_attn.norm.weight", "model.layers.2.linear_attn.A_log",
                 "model.layers.2.linear_attn.dt_bias", "model.layers.0.linear_attn.conv1d.weight"):
        assert t[name].std() > 0.01, name
    assert not np.allclose(t["model.layers.0.linear_attn.norm.weight"], 1.0)


def test_checkpoints_are_deterministic(tmp_path: Path) -> None:
    a = tiny_qwen35.write_qwen35_hf(tmp_path / "a", n_mtp=1, seed=3)
    b = tiny_qwen35.write_qwen35_hf(tmp_path / "b", n_mtp=1, seed=3)
    c = tiny_qwen35.write_qwen35_hf(tmp_path / "c", n_mtp=1, seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize(("moe", "n_mtp", "variant"), [
    (False, 0, "full"), (False, 1, "full"), (False, 1, "no_mtp"), (False, 1, "mtp_only"), (False, 2, "full"),
    (True, 0, "full"), (True, 1, "full"), (True, 1, "no_mtp"), (True, 1, "mtp_only"), (True, 2, "mtp_only"),
])
def test_gguf_variants_read_as_the_config_says(moe: bool, n_mtp: int, variant: tiny_qwen35.Variant) -> None:
    f = GGUFFile(tiny_qwen35.tiny_qwen35_gguf_path(moe=moe, n_mtp=n_mtp, variant=variant))
    hp = read_hparams(f, implements=FEATURES)
    kept = 0 if variant == "no_mtp" else n_mtp
    assert f.architecture == ("qwen35moe" if moe else "qwen35")
    assert (hp.n_layer, hp.n_nextn, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_rot) == (4, kept, 64, 4, 2, 32, 8)
    dn = hp.delta_net
    assert dn is not None and dn.recurrent == (True, False, True, False)
    assert (dn.conv_kernel, dn.n_k_heads, dn.n_v_heads, dn.head_k_dim, dn.head_v_dim) == (4, 2, 4, 16, 16)
    assert [hp.is_recurrent(i) for i in range(4 + kept)] == [True, False, True, False] + [False] * kept
    assert f.get(f"{f.architecture}.rope.dimension_sections") == [2, 1, 1, 0]
    assert hp.recipe.attn_output_gate and hp.has_qk_norm and not hp.tied_output
    if moe:
        assert hp.moe is not None and (hp.moe.n_expert, hp.moe.n_expert_used, hp.moe.n_ff_exp) == (4, 2, 32)
        assert hp.moe.n_expert_shared == 1 and hp.moe.n_ff_shexp == 32 and hp.moe.shared_gate
    else:
        assert hp.moe is None and hp.n_ff == 128
    trunk = f.has_tensor("blk.0.ssm_a") and f.has_tensor("blk.1.attn_q.weight")
    assert trunk == (variant != "mtp_only")
    assert f.has_tensor("blk.4.nextn.eh_proj.weight") == (kept > 0)
    assert f.has_tensor("token_embd.weight") and f.has_tensor("output.weight")


def _edited(src: Path, dst: Path, **changes: Any) -> Path:
    """`src` with metadata keys (``arch.`` + key, ``__`` for ``.``) replaced, or removed when None."""
    f = GGUFFile(src)
    arch = str(f.architecture)
    meta = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    for key, value in changes.items():
        full = f"{arch}.{key.replace('__', '.')}"
        if value is None:
            meta.pop(full)
        else:
            meta[full] = value
    tensors = {t.name: np.array(t.data) for t in f.tensors()}
    return write_gguf(dst, arch, {}, tensors, meta)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"ssm__group_count": None}, "ssm.group_count"),
    ({"ssm__inner_size": None}, "ssm.inner_size"),
    ({"attention__recurrent_layers": [True, False, True]}, "one flag per block (4 or 5)"),
    ({"attention__recurrent_layers": [True, False, True, False, True]}, "marks an MTP block recurrent"),
    ({"ssm__time_step_rank": 3}, "must be a multiple of ssm.group_count"),
])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bad_hybrid_fixture_is_refused_by_name(moe: bool, changes: dict[str, Any], needle: str, tmp_path: Path) -> None:
    bad = _edited(tiny_qwen35.tiny_qwen35_gguf_path(moe=moe, n_mtp=1), tmp_path / "bad.gguf", **changes)
    with pytest.raises(ModelFileError, match=re.escape(needle)):
        read_hparams(GGUFFile(bad), implements=FEATURES)


def test_an_unedited_copy_reads_the_same(tmp_path: Path) -> None:
    """The editing helper itself changes nothing else (so the refusals above are the edits' doing)."""
    src = tiny_qwen35.tiny_qwen35_gguf_path(moe=True, n_mtp=1)
    assert read_hparams(GGUFFile(_edited(src, tmp_path / "same.gguf")), implements=FEATURES) \
        == read_hparams(GGUFFile(src), implements=FEATURES)
