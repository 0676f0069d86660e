"""GGUF hyper-parameters, dequantization and weight loading, including every clear-error path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.recipes import FEATURES
from spekula.backends.gguf.weights import dequantize, load_model_weights, rope_inv_freq
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile, TensorEntry
from spekula.fixtures.tiny_gguf import quantize_fixture, tiny_model_path, write_gguf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hparams_of_tiny_fixtures(arch: str) -> None:
    hp = read_hparams(GGUFFile(tiny_model_path(arch)))
    assert (hp.arch, hp.n_vocab, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff) == (
        arch, 320, 64, 4, 2, 16, 128,
    )
    assert hp.n_layer == 4 and hp.n_rot == 16 and hp.rope_scale == 1.0
    assert hp.rope_neox == (arch != "llama")
    assert hp.has_qkv_bias == (arch == "qwen2")
    assert hp.has_qk_norm == (arch == "qwen3")
    assert hp.tied_output
    assert hp.attn_scale == pytest.approx(0.25)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_load_weights_shapes_and_optional_tensors(arch: str) -> None:
    f = GGUFFile(tiny_model_path(arch))
    hp = read_hparams(f)
    w = load_model_weights(f, hp=hp)
    assert "output.weight" not in w  # tied
    assert w["token_embd.weight"].shape == (320, 64) and w["token_embd.weight"].dtype == np.float32
    assert w["blk.3.attn_k.weight"].shape == (32, 64)
    assert ("blk.0.attn_q.bias" in w) == (arch == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in w) == (arch == "qwen3")
    assert all(np.isfinite(a).all() for a in w.values())


TOLERANCE = {"MXFP4": 0.5, "F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.03, "Q5_1": 0.15, "Q5_0": 0.2, "Q4_1": 0.3, "Q4_0": 0.4}


@pytest.mark.parametrize("type_name", sorted(TOLERANCE))
def test_dequantize_matches_source_values(type_name: str) -> None:
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    data = x.copy() if type_name == "F32" else gguf.quants.quantize(x, qtype)
    out = dequantize(TensorEntry("t", type_name, (3, 64), data))
    assert out.shape == (3, 64) and out.dtype == np.float32
    assert np.abs(out - x).max() <= TOLERANCE[type_name]


def _f16(v: float) -> bytes:
    return np.float16(v).tobytes()


def test_q4_k_known_block() -> None:
    # 6-bit scales all 1, mins all 0 (bytes 0..3 = scale, 4..7 = min, 8..11 = low nibbles of both).
    scales = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    qs = bytes([0x21] * 128)  # low nibble 1 for the first 32 of each 64, high nibble 2 for the next 32
    block = _f16(0.5) + _f16(3.0) + scales + qs
    out = dequantize(TensorEntry("t", "Q4_K", (1, 256), np.frombuffer(block, np.uint8).reshape(1, -1)))
    want = np.tile(np.repeat([0.5, 1.0], 32), 4)
    assert np.array_equal(out[0], want)


def test_q5_k_known_block() -> None:
    scales = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    block = _f16(0.25) + _f16(0.0) + scales + bytes([0xFF] * 32) + bytes([0x11] * 128)
    out = dequantize(TensorEntry("t", "Q5_K", (1, 256), np.frombuffer(block, np.uint8).reshape(1, -1)))
    assert np.array_equal(out[0], np.full(256, 0.25 * 17))  # q = 1 | (1 << 4)


def test_q6_k_known_block() -> None:
    block = bytes(128) + bytes(64) + bytes([2] * 16) + _f16(0.125)
    out = dequantize(TensorEntry("t", "Q6_K", (1, 256), np.frombuffer(block, np.uint8).reshape(1, -1)))
    assert np.array_equal(out[0], np.full(256, 0.125 * 2 * -32))


# Types the gguf package reads but cannot write: the fixtures' own quantizers, decoded by gguf.
FIXTURE_TOLERANCE = {"IQ4_NL": 0.35, "IQ4_XS": 0.35, "Q3_K": 0.6, "Q2_K": 1.0}


@pytest.mark.parametrize("type_name", sorted(FIXTURE_TOLERANCE))
def test_dequantize_of_fixture_quantized_types(type_name: str) -> None:
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    data = quantize_fixture(x, type_name)
    out = dequantize(TensorEntry("t", type_name, (3, 512), data))
    assert np.array_equal(out, gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]).reshape(3, 512))
    assert np.abs(out - x).max() <= FIXTURE_TOLERANCE[type_name]


def test_iq4_nl_known_block() -> None:
    block = _f16(0.5) + bytes([0xF0] * 8 + [0x97] * 8)  # codes 0 / 7 low, 15 / 9 high
    out = dequantize(TensorEntry("t", "IQ4_NL", (1, 32), np.frombuffer(block, np.uint8).reshape(1, -1)))
    want = np.array([-127] * 8 + [-10] * 8 + [113] * 8 + [13] * 8, np.float32) * 0.5
    assert np.array_equal(out[0], want)


def test_iq4_xs_known_block() -> None:
    # 6-bit scales: block j's low 4 bits in scales_l, high 2 in scales_h; here ls = 33 (step d) for even
    # blocks and 30 (step -2d) for odd ones: low nibbles 1 / 14, high bits 2 / 1
    scales_h = sum((2 if j % 2 == 0 else 1) << (2 * j) for j in range(8))
    block = _f16(0.25) + int(scales_h).to_bytes(2, "little") + bytes([0xE1] * 4) + bytes([0xF8] * 128)
    out = dequantize(TensorEntry("t", "IQ4_XS", (1, 256), np.frombuffer(block, np.uint8).reshape(1, -1)))
    codes = np.array([1] * 16 + [113] * 16, np.float32)  # code 8 low, 15 high
    want = np.concatenate([codes * (0.25 if j % 2 == 0 else -0.5) for j in range(8)])
    assert np.array_equal(out[0], want)


def test_mxfp4_known_block() -> None:
    # E8M0 exponent 126 (2^-1), halved for the doubled FP4 table values: 2^-2 times the table value
    block = bytes([126]) + bytes([0xF7] * 8 + [0x19] * 8)  # codes 7 / 15 low (12, -12), 9 / 1 high (-1, 1)
    out = dequantize(TensorEntry("t", "MXFP4", (1, 32), np.frombuffer(block, np.uint8).reshape(1, -1)))
    want = np.array([12] * 8 + [-1] * 8 + [-12] * 8 + [1] * 8, np.float32) * 0.25
    assert np.array_equal(out[0], want)


def test_q3_k_known_block() -> None:
    # hmask bit j set for the even 32-value blocks (no -4 there); qs 0b11 in every 2-bit field: value 3 / -1;
    # scales: low 4 bits 1 (bytes 0-7), high 2 bits 2 (bytes 8-11): 33 - 32 = 1 for all 16
    block = bytes([0x55] * 32) + bytes([0xFF] * 64) + bytes([0x11] * 8) + bytes([0xAA] * 4) + _f16(0.5)
    out = dequantize(TensorEntry("t", "Q3_K", (1, 256), np.frombuffer(block, np.uint8).reshape(1, -1)))
    assert np.array_equal(out[0], np.concatenate([np.full(32, 1.5 if j % 2 == 0 else -0.5) for j in range(8)]))


def test_q2_k_known_block() -> None:
    # per 16 values: scale 2 and minimum 1 (byte 0x12); every 2-bit field 0b10: value 2 * 2 * d - 1 * dmin
    block = bytes([0x12] * 16) + bytes([0xAA] * 64) + _f16(0.5) + _f16(0.25)
    out = dequantize(TensorEntry("t", "Q2_K", (1, 256), np.frombuffer(block, np.uint8).reshape(1, -1)))
    assert np.array_equal(out[0], np.full(256, 0.5 * 2 * 2 - 0.25))


def test_unsupported_tensor_type_and_short_data() -> None:
    with pytest.raises(ModelFileError, match=r"m\.gguf: tensor 't' has unsupported type IQ2_XXS \(supported: F32, .*Q8_0"):
        dequantize(TensorEntry("t", "IQ2_XXS", (1, 256), np.zeros((1, 66), np.uint8)), "m.gguf")
    with pytest.raises(ModelFileError, match="cannot decode tensor 't'"):
        dequantize(TensorEntry("t", "F16", (4, 64), np.zeros(10, np.float16)), "m.gguf")


# ---- whole files with one thing wrong -------------------------------------------------------------


def _rewrite(tmp: Path, *, arch: str = "llama", drop: tuple[str, ...] = (), meta: dict[str, Any] | None = None,
             arch_out: str | None = None, fuse_qkv: bool = False) -> Path:
    """Copy a tiny fixture with changes (tensors written as float32)."""
    f = GGUFFile(tiny_model_path(arch))
    tensors = {e.name: dequantize(e) for e in f.tensors() if e.name not in drop}
    if fuse_qkv:
        for i in range(read_hparams(f).n_layer):
            parts = [tensors.pop(f"blk.{i}.attn_{k}.weight") for k in "qkv"]
            tensors[f"blk.{i}.attn_qkv.weight"] = np.concatenate(parts)
    keys = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    out_arch = arch_out or arch
    keys = {(out_arch + k[len(arch):] if k.startswith(arch + ".") else k): v for k, v in keys.items()}
    keys.update(meta or {})
    return write_gguf(tmp / "m.gguf", out_arch, {}, tensors, keys)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = _rewrite(tmp_path, arch_out="gpt2")
    with pytest.raises(ModelFileError, match=r"m\.gguf: unsupported architecture 'gpt2'"):
        read_hparams(GGUFFile(path))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    f = GGUFFile(_rewrite(tmp_path, drop=("blk.2.ffn_up.weight",)))
    with pytest.raises(ModelFileError, match=r"m\.gguf: missing tensor 'blk\.2\.ffn_up\.weight'"):
        load_model_weights(f, hp=read_hparams(f))


def test_wrong_tensor_shape_is_named(tmp_path: Path) -> None:
    f = GGUFFile(_rewrite(tmp_path, meta={"llama.feed_forward_length": 96}))
    with pytest.raises(ModelFileError, match=r"blk\.0\.ffn_gate\.weight' has shape \(128, 64\), expected \(96, 64\)"):
        load_model_weights(f, hp=read_hparams(f))


def test_truncated_file(tmp_path: Path) -> None:
    src = tiny_model_path("qwen2").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src[: len(src) - 1000])
    with pytest.raises(ModelFileError, match="cut.gguf"):
        f = GGUFFile(cut)
        load_model_weights(f, hp=read_hparams(f))


def test_fused_qkv_is_split_back(tmp_path: Path) -> None:
    ref_f = GGUFFile(tiny_model_path("llama"))
    ref = load_model_weights(ref_f, hp=read_hparams(ref_f))
    f = GGUFFile(_rewrite(tmp_path, fuse_qkv=True))
    got = load_model_weights(f, hp=read_hparams(f))
    for k in "qkv":
        assert np.array_equal(got[f"blk.1.attn_{k}.weight"], ref[f"blk.1.attn_{k}.weight"])


def test_linear_rope_scaling_and_rope_freqs(tmp_path: Path) -> None:
    f = GGUFFile(_rewrite(tmp_path, meta={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}))
    hp = read_hparams(f)
    assert hp.rope_scale == 0.25
    base = rope_inv_freq(hp, {})
    assert base[0] == 0.25
    ff = np.full(hp.n_rot // 2, 2.0, np.float32)
    assert np.allclose(rope_inv_freq(hp, {"rope_freqs.weight": ff}), base / 2)


def test_yarn_needs_a_runtime_with_its_magnitude(tmp_path: Path) -> None:
    f = GGUFFile(_rewrite(tmp_path, meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}))
    with pytest.raises(ModelFileError, match="does not implement: YaRN rope magnitude scaling"):
        read_hparams(f)
    hp = read_hparams(f, implements=FEATURES)
    assert hp.scaling.yarn is not None and hp.rope_scale == 1.0  # the blend is YaRN's, not linear
    assert hp.rope_mscale == pytest.approx(1.0 + 0.1 * np.log(4.0))


def test_unknown_rope_scaling_is_refused(tmp_path: Path) -> None:
    f = GGUFFile(_rewrite(tmp_path, meta={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}))
    with pytest.raises(ModelFileError, match="unsupported rope scaling 'longrope' \\(supported: none, linear, yarn\\)"):
        read_hparams(f)


@pytest.mark.slow
def test_smollm2_hparams_and_load() -> None:
    from backend_conformance import smollm2_path

    f = GGUFFile(smollm2_path())
    hp = read_hparams(f)
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_vocab) == ("llama", 30, 576, 9, 3, 49152)
    assert hp.tied_output and not hp.rope_neox and hp.rope_base == 100000.0
    w = load_model_weights(f, hp=hp)
    assert w["blk.29.ffn_down.weight"].shape == (576, 1536)
