"""YaRN rope scaling for any architecture (backends/gguf/rope_scaling.py).

The frequencies and magnitude against transformers' own YaRN (``ROPE_INIT_FUNCTIONS["yarn"]``) over
bases, factors, original contexts and partial rotation; which YaRN keys an architecture reads (llama.cpp's
llama and qwen graphs ignore the betas a converter writes, mistral3 reads them); and tiny llama and qwen3
checkpoints with ``rope_scaling = yarn``, converted by llama.cpp's converter, against transformers' fp32
forward on the torch, native and onnx backends at positions past the original context.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.recipes import ARCHITECTURES, FEATURES
from spekula.backends.gguf.rope_scaling import YARN_FILE_KEYS, read_position_scaling, rope_frequencies
from spekula.backends.gguf.weights import dequantize
from spekula.core.backend import BackendOptions, SeqInput, load_backend
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures import tiny_hf
from spekula.fixtures.llamacpp_convert import llamacpp_convert
from spekula.fixtures.tiny_gguf import tiny_model_path, write_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGIT_TOL = {"torch": 1e-3, "onnx": 1e-3, "native": 5e-3}  # as tests/backends/test_ministral3.py
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def _hf_yarn(head_dim: int, base: float, rope: dict[str, Any], partial: float = 1.0) -> tuple[np.ndarray, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=
                      int(rope["factor"] * rope["original_max_position_embeddings"]),
                      rope_parameters={"rope_theta": base, "partial_rotary_factor": partial, **rope})
    inv, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    return inv.double().numpy(), float(attention_factor)


def _scaling(keys: dict[str, Any], yarn_keys: frozenset[str] = frozenset(), n_ctx_train: int = 4096) -> Any:
    f = GGUFFile(tiny_model_path("llama"))  # only named in errors
    return read_position_scaling(f, lambda key, default: keys.get(key, default), n_ctx_train, yarn_keys, False)


@pytest.mark.parametrize(("head_dim", "partial", "base", "factor", "orig"), [
    (16, 1.0, 100.0, 4.0, 16), (64, 1.0, 10000.0, 8.0, 4096), (128, 1.0, 1e6, 32.0, 4096),
    (128, 1.0, 150000.0, 32.0, 4096), (64, 0.5, 10000.0, 4.0, 2048), (32, 1.0, 500000.0, 2.0, 8192),
    (128, 1.0, 1e6, 4.0, 32768)])  # the last: Qwen3's published YaRN setting
def test_frequencies_and_magnitude_match_transformers(head_dim: int, partial: float, base: float, factor: float,
                                                      orig: int) -> None:
    want_inv, want_mscale = _hf_yarn(head_dim, base, {"rope_type": "yarn", "factor": factor,
                                                      "original_max_position_embeddings": orig}, partial)
    scaling = _scaling({"rope.scaling.type": "yarn", "rope.scaling.factor": factor,
                        "rope.scaling.original_context_length": orig})
    n_rot = int(head_dim * partial)
    got = rope_frequencies(n_rot, base, scaling, None)
    # transformers computes in float32, the projects' tables in float64
    np.testing.assert_allclose(got, want_inv, rtol=2e-6)
    assert scaling.rope_mscale == pytest.approx(want_mscale, rel=1e-6) == 1.0 + 0.1 * math.log(factor)
    assert scaling.yarn is not None and scaling.freq_scale == 1.0


def test_log_multiplier_and_betas_are_read_only_where_the_graph_reads_them() -> None:
    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": 16.0, "rope.scaling.original_context_length": 64,
            "rope.scaling.yarn_beta_fast": 4.0, "rope.scaling.yarn_beta_slow": 0.5,
            "rope.scaling.yarn_log_multiplier": 0.5, "rope.scaling.attn_factor": 2.0}
    llama = _scaling(keys).yarn  # llama.cpp's llama graph: the defaults, whatever the file says
    assert llama is not None and (llama.beta_fast, llama.beta_slow) == (32.0, 1.0)
    assert llama.mscale == pytest.approx(2.0 * (1.0 + 0.1 * math.log(16.0)))
    mistral = _scaling(keys, frozenset({"yarn_beta_fast", "yarn_beta_slow", "yarn_log_multiplier"})).yarn
    assert mistral is not None and (mistral.beta_fast, mistral.beta_slow) == (4.0, 0.5)
    want_inv, want_mscale = _hf_yarn(16, 100.0, {"rope_type": "yarn", "factor": 16.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 4.0,
                                                 "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.5})
    assert mistral.mscale == pytest.approx(2.0 * want_mscale)
    np.testing.assert_allclose(mistral.blend(100.0 ** (-np.arange(8) / 8.0), 16, 100.0), want_inv, rtol=2e-6)


def test_ministral3_published_setting_has_magnitude_one() -> None:
    """Ministral 3 ships mscale = mscale_all_dim = 1 (converted to yarn_log_multiplier 1): its YaRN magnitude is 1,
    as transformers' attention_factor, and its blend is transformers' over the 128-wide heads."""
    rope = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    want_inv, want_mscale = _hf_yarn(128, 1e6, rope)
    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": 16.0, "rope.scaling.original_context_length": 16384,
            "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
            "rope.scaling.yarn_log_multiplier": 1.0}
    scaling = _scaling(keys, frozenset({"yarn_beta_fast", "yarn_beta_slow", "yarn_log_multiplier"}))
    assert scaling.rope_mscale == want_mscale == 1.0
    np.testing.assert_allclose(rope_frequencies(128, 1e6, scaling, None), want_inv, rtol=2e-6)


def test_recipes_name_only_yarn_keys_llamacpp_has() -> None:
    for arch, recipe in ARCHITECTURES.items():
        assert recipe.yarn_keys <= YARN_FILE_KEYS, arch
    assert ARCHITECTURES["mistral3"].yarn_keys and not ARCHITECTURES["llama"].yarn_keys


def test_linear_and_none_keep_their_meaning() -> None:
    assert _scaling({"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}).freq_scale == 0.25
    assert _scaling({"rope.scaling.factor": 4.0}).freq_scale == 0.25  # no type: llama.cpp's default, linear
    assert _scaling({"rope.scale_linear": 2.0}).freq_scale == 0.5  # the older key
    assert _scaling({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}).freq_scale == 1.0
    assert _scaling({}).yarn is None and _scaling({}).rope_mscale == 1.0


# ---- converted checkpoints against transformers ----------------------------------------------------


@cache
def _checkpoint(arch: str, root: Path) -> tuple[Path, Path]:
    hf = root / f"hf-{arch}"
    tiny_hf.write_target(hf, arch, n_layer=2, tied=False)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(rope_theta=100.0, max_position_embeddings=64, rope_scaling=dict(YARN))
    (hf / "config.json").write_text(json.dumps(cfg, indent=1))
    return hf, llamacpp_convert(hf, root / f"{arch}-yarn.gguf", "f32")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("yarn")


@pytest.mark.parametrize("name", ["torch", "native", "onnx"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_converted_yarn_checkpoint_matches_transformers(arch: str, name: str, out_dir: Path) -> None:
    if name == "onnx":
        pytest.importorskip("onnxruntime")
    hf, path = _checkpoint(arch, out_dir)
    f = GGUFFile(path)
    assert f.get(f"{arch}.rope.scaling.type") == "yarn"
    assert read_hparams(f, implements=FEATURES).scaling.yarn is not None
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    assert model.model.rotary_emb.attention_scaling == pytest.approx(1.0 + 0.1 * math.log(4.0))
    ids = np.random.default_rng(4).integers(0, 320, 80).astype(np.int32)
    with torch.no_grad():
        want = model(torch.tensor([ids.tolist()])).logits[0].numpy()
    b = load_backend(name, str(path), BackendOptions(n_ctx=128, n_seq_max=1, threads=1))
    s = b.new_seq()
    got = b.forward([SeqInput(s, ids, 0, np.arange(ids.size))])[0].logits
    assert np.abs(got - want).max() < LOGIT_TOL[name]


def test_draft_heads_refuse_yarn(tmp_path: Path) -> None:
    """The draft runtimes rope with one frequency scale: a YaRN head is refused, not roped unscaled."""
    from spekula.core.drafting.draft_models import read_draft_attention
    from spekula.core.errors import ModelFileError

    f = GGUFFile(tiny_model_path("llama"))
    keys = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    keys |= {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "y.gguf", "llama", {}, {e.name: dequantize(e) for e in f.tensors()}, keys)
    with pytest.raises(ModelFileError, match="draft heads with 'yarn' rope scaling are not supported"):
        read_draft_attention(GGUFFile(path), "llama", 64)
