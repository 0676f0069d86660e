"""The architecture table (backends/gguf/architecture.py): each fixture parses to its recipe, anything
unsupported is one error naming it, and no backend dispatches on an architecture's name."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spekula.backends.gguf import architecture, recipes
from spekula.backends.gguf.architecture import MoEParams, read_hparams
from spekula.backends.gguf.recipes import ARCHITECTURES, BlockRecipe
from spekula.backends.gguf.weights import dequantize, load_model_weights
from spekula.backends.native.backend import NativeBackend
from spekula.core.backend import BackendOptions
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures.tiny_gguf import tiny_model_path, write_gguf
from spekula.fixtures.tiny_moe import tiny_moe_gguf_path

BACKENDS = Path(architecture.__file__).resolve().parents[1]


def _copy(tmp: Path, src: Path, *, meta: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """`src` rewritten with extra metadata and without the `drop` tensors (float32)."""
    f = GGUFFile(src)
    tensors = {e.name: dequantize(e) for e in f.tensors() if e.name not in drop}
    keys = {k: v for k, v in f.metadata.items() if k != "general.architecture"} | (meta or {})
    return write_gguf(tmp / "m.gguf", f.architecture, {}, tensors, keys)


# (rope, q/k norm, q/k/v biases, norm before the FFN) each dense fixture resolves to
DENSE = {"llama": ("norm", False, False, "ffn_norm"), "qwen2": ("neox", False, True, "ffn_norm"),
         "qwen3": ("neox", True, False, "ffn_norm")}


@pytest.mark.parametrize("arch", list(DENSE))
def test_dense_fixture_parses_to_its_recipe(arch: str) -> None:
    hp = read_hparams(GGUFFile(tiny_model_path(arch)))
    assert hp.recipe is ARCHITECTURES[arch]
    assert (hp.recipe.rope, hp.has_qk_norm, hp.has_qkv_bias, hp.ffn_norm_name) == DENSE[arch]
    assert (hp.recipe.norm, hp.recipe.activation, hp.moe) == ("rms", "swiglu", None)
    assert (hp.sliding_window, hp.attn_softcap, hp.final_softcap) == (0, 0.0, 0.0)


MOE = {
    "qwen3moe": (True, False, "ffn_norm", MoEParams(4, 2, 32, 0, 0, "softmax", True, 1.0, False)),
    "glm4moe": (False, True, "post_attention_norm", MoEParams(4, 2, 32, 1, 1, "sigmoid", True, 2.5, True)),
}


@pytest.mark.parametrize("arch", list(MOE))
def test_moe_fixture_parses_to_its_recipe_and_routing(arch: str) -> None:
    hp = read_hparams(GGUFFile(tiny_moe_gguf_path(arch)))
    assert hp.recipe is ARCHITECTURES[arch] and hp.rope_neox
    assert (hp.has_qk_norm, hp.has_qkv_bias, hp.ffn_norm_name, hp.moe) == MOE[arch]


def test_optional_qk_norm_follows_the_file() -> None:
    assert read_hparams(GGUFFile(tiny_moe_gguf_path("glm4moe", qk_norm=True))).has_qk_norm


def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    f = GGUFFile(tiny_model_path("llama"))
    tensors = {e.name: dequantize(e) for e in f.tensors()}
    keys = {("gemma2" + k[5:] if k.startswith("llama.") else k): v for k, v in f.metadata.items()
            if k != "general.architecture"}
    path = write_gguf(tmp_path / "g.gguf", "gemma2", {}, tensors, keys)
    with pytest.raises(ModelFileError, match=r"g\.gguf: unsupported architecture 'gemma2' \(supported: llama, qwen2, "
                                             r"qwen3, qwen3moe, glm4moe, qwen35, qwen35moe, gemma3, gemma4, mistral3, gpt-oss\)"):
        read_hparams(GGUFFile(path))


def _with_recipe(monkeypatch: pytest.MonkeyPatch, arch: str, **changes: Any) -> None:
    monkeypatch.setitem(ARCHITECTURES, arch, dataclasses.replace(ARCHITECTURES[arch], **changes))


def test_unsupported_recipe_options_are_one_error_naming_each(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_recipe(monkeypatch, "llama", norm="layer")
    with pytest.raises(ModelFileError, match=r"architecture 'llama' needs what no backend implements yet: layer norm$"):
        read_hparams(GGUFFile(tiny_model_path("llama")))


def test_options_a_runtime_lacks_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Post-norms, the GELU gate and sinks run on native and torch; a runtime that does not declare them refuses."""
    _with_recipe(monkeypatch, "llama", activation="geglu", post_norms=True, attn_sinks=True)
    with pytest.raises(ModelFileError, match=r"architecture 'llama' needs what the onnx backend does not implement: "
                                             r"GELU-gated FFN, attention sinks, norms after the attention and FFN "
                                             r"outputs$"):
        read_hparams(GGUFFile(tiny_model_path("llama")), runtime="the onnx backend")


def test_recipe_options_read_from_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Sliding windows and soft-capping are read only where the recipe says so, and refused when set."""
    meta = {"llama.attention.sliding_window": 4096, "llama.attn_logit_softcapping": 50.0,
            "llama.final_logit_softcapping": 30.0}
    path = _copy(tmp_path, tiny_model_path("llama"), meta=meta)
    hp = read_hparams(GGUFFile(path))  # llama's graph has none of them: the keys are not its business
    assert (hp.sliding_window, hp.attn_softcap, hp.final_softcap) == (0, 0.0, 0.0)
    _with_recipe(monkeypatch, "llama", sliding_window=True, logit_softcap=True)
    with pytest.raises(ModelFileError, match=r"needs what no backend implements yet: attention logit soft-capping "
                                             r"\(50\.0\)$"):
        read_hparams(GGUFFile(path))
    _with_recipe(monkeypatch, "llama", sliding_window=True, logit_softcap=True, swa_period=2)
    del meta["llama.attn_logit_softcapping"]
    hp = read_hparams(GGUFFile(_copy(tmp_path, tiny_model_path("llama"), meta=meta)), implements=recipes.FEATURES)
    assert (hp.sliding_window, hp.swa_layers, hp.final_softcap) == (4096, (True, False, True, False), 30.0)
    plain = read_hparams(GGUFFile(tiny_model_path("llama")))  # the same recipe, keys absent: nothing to refuse
    assert (plain.sliding_window, plain.attn_softcap, plain.final_softcap) == (0, 0.0, 0.0)


def test_required_attention_bias_is_a_missing_tensor(tmp_path: Path) -> None:
    names = tuple(f"blk.{i}.attn_{k}.bias" for i in range(4) for k in "qkv")
    f = GGUFFile(_copy(tmp_path, tiny_model_path("qwen2"), drop=names))
    with pytest.raises(ModelFileError, match=r"missing tensor 'blk\.0\.attn_q\.bias'"):
        load_model_weights(f, hp=read_hparams(f))
    with pytest.raises(ModelFileError, match=r"missing tensor 'blk\.0\.attn_q\.bias'"):
        NativeBackend(str(f.path), BackendOptions(n_ctx=64, n_seq_max=1, threads=1))


def test_blocks_the_description_gives_no_bias_read_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An optional bias is probed on the first block: no backend picks up a later block's bias on its own."""
    _with_recipe(monkeypatch, "qwen2", attn_bias="optional")
    path = _copy(tmp_path, tiny_model_path("qwen2"), drop=tuple(f"blk.0.attn_{k}.bias" for k in "qkv"))
    f = GGUFFile(path)
    hp = read_hparams(f)
    assert not hp.has_qkv_bias and "blk.1.attn_q.bias" not in load_model_weights(f, hp=hp)
    native = NativeBackend(str(path), BackendOptions(n_ctx=64, n_seq_max=1, threads=1))
    try:
        assert [native._layers[i].wq.bias for i in range(hp.n_layer)] == [None] * hp.n_layer
    finally:
        native.close()


@pytest.mark.parametrize(("gating_id", "gating"), [(0, "sigmoid"), (1, "softmax"), (2, "sigmoid")])
def test_routing_keys_the_recipe_reads(gating_id: int, gating: str, tmp_path: Path) -> None:
    path = _copy(tmp_path, tiny_moe_gguf_path("glm4moe"), meta={"glm4moe.expert_gating_func": gating_id})
    moe = read_hparams(GGUFFile(path)).moe
    assert moe is not None and moe.gating == gating


def test_routing_keys_the_recipe_ignores(tmp_path: Path) -> None:
    """qwen3moe's graph fixes its routing: routing keys in the file change nothing."""
    meta = {"qwen3moe.expert_gating_func": 2, "qwen3moe.expert_weights_norm": False,
            "qwen3moe.expert_shared_count": 1, "qwen3moe.leading_dense_block_count": 1}
    hp = read_hparams(GGUFFile(_copy(tmp_path, tiny_moe_gguf_path("qwen3moe"), meta=meta)))
    assert hp.moe == MOE["qwen3moe"][3]


def test_unknown_gating_function_is_named(tmp_path: Path) -> None:
    path = _copy(tmp_path, tiny_moe_gguf_path("glm4moe"), meta={"glm4moe.expert_gating_func": 3})
    with pytest.raises(ModelFileError, match=r"unsupported expert_gating_func 3 \(supported: 1 softmax, 2 sigmoid\)"):
        read_hparams(GGUFFile(path))


def test_every_recipe_is_a_block_recipe() -> None:
    assert all(isinstance(r, BlockRecipe) for r in ARCHITECTURES.values())
    assert all(r.moe is None or r.moe.file_keys <= recipes.MOE_FILE_KEYS for r in ARCHITECTURES.values())


@pytest.mark.parametrize("backend", ["native", "torch", "onnx"])
def test_no_backend_dispatches_on_an_architecture_name(backend: str) -> None:
    """The forwards read the description; an architecture's name in their code would re-derive it."""
    found = []
    for path in sorted((BACKENDS / backend).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ARCHITECTURES:
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not found, found


def _hybrid(tmp: Path, **keys: Any) -> Path:
    """A header-only qwen35 file: the keys a hybrid description reads, `keys` overriding or (None) removing them."""
    base: dict[str, Any] = {
        "qwen35.embedding_length": 64, "qwen35.block_count": 5, "qwen35.nextn_predict_layers": 1,
        "qwen35.feed_forward_length": 128, "qwen35.attention.head_count": 4, "qwen35.attention.head_count_kv": 2,
        "qwen35.attention.key_length": 16, "qwen35.attention.value_length": 16, "qwen35.rope.dimension_count": 4,
        "qwen35.attention.layer_norm_rms_epsilon": 1e-6, "qwen35.ssm.conv_kernel": 4, "qwen35.ssm.inner_size": 64,
        "qwen35.ssm.state_size": 16, "qwen35.ssm.time_step_rank": 4, "qwen35.ssm.group_count": 2,
        "qwen35.full_attention_interval": 2}
    meta = {k: v for k, v in (base | {f"qwen35.{k.replace('__', '.')}": v for k, v in keys.items()}).items()
            if v is not None}
    tensors = {"token_embd.weight": np.zeros((32, 64), np.float32), "blk.0.attn_norm.weight": np.ones(64, np.float32)}
    return write_gguf(tmp / "h.gguf", "qwen35", {}, tensors, meta)


def test_hybrid_description_reads_sizes_and_the_recurrent_pattern(tmp_path: Path) -> None:
    hp = read_hparams(GGUFFile(_hybrid(tmp_path)), implements=recipes.FEATURES)
    dn = hp.delta_net
    assert dn is not None and hp.n_layer == 4 and hp.n_nextn == 1
    assert (dn.conv_kernel, dn.n_k_heads, dn.n_v_heads, dn.head_k_dim, dn.head_v_dim) == (4, 2, 4, 16, 16)
    assert dn.recurrent == (True, False, True, False) and hp.is_recurrent(0) and not hp.is_recurrent(4)
    assert dn.conv_dim == 2 * 32 + 64 and hp.recipe.attn_output_gate
    flags = read_hparams(GGUFFile(_hybrid(tmp_path, attention__recurrent_layers=[False, True, True, False, False])),
                         implements=recipes.FEATURES).delta_net
    assert flags is not None and flags.recurrent == (False, True, True, False)


@pytest.mark.parametrize(("keys", "needle"), [
    ({"ssm__state_size": None}, "qwen35.ssm.state_size"),
    ({"ssm__time_step_rank": 3}, "must be a multiple of ssm.group_count"),
    ({"attention__recurrent_layers": [True, False]}, "one flag per block"),
    ({"attention__recurrent_layers": [True, False, True, False, True]}, "marks an MTP block recurrent"),
    ({"ssm__conv_kernel": 1}, "conv_kernel"),
])
def test_bad_hybrid_files_are_named(tmp_path: Path, keys: dict[str, Any], needle: str) -> None:
    with pytest.raises(ModelFileError, match=re.escape(needle)):
        read_hparams(GGUFFile(_hybrid(tmp_path, **keys)), implements=recipes.FEATURES)


def test_a_runtime_without_the_hybrid_operations_refuses_by_name(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="needs what the onnx backend does not implement: gated attention output, "
                                             "gated delta-net blocks"):
        read_hparams(GGUFFile(_hybrid(tmp_path)), runtime="the onnx backend")
