"""`spekula convert`: llama.cpp names/keys, tokenizer, plain targets through the torch backend, clear errors."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from checkpoint_edits import edit_config, edit_tensors
from output_paths import UNWRITABLE, unwritable_output
from safetensors.numpy import load_file

from spekula.backends.convert.hf import convert
from spekula.backends.convert.plain import unpermute_qk
from spekula.core.errors import ConfigError, ModelFileError, SpekulaError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures import tiny_hf
from spekula.frontends.cli.main import main as cli_main


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf.write_target(tmp_path_factory.mktemp("t") / "hf", "llama", n_layer=8)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_plain_target_names_keys_and_permutation(arch: str, tmp_path: Path) -> None:
    hf = tiny_hf.write_target(tmp_path / "hf", arch, n_layer=2, tied=arch != "qwen2")
    out = tmp_path / "m.gguf"
    assert convert(hf, out, outtype="f32") == ("plain", out)
    f = GGUFFile(out)
    assert f.architecture == arch
    assert f.get(f"{arch}.block_count") == 2 and f.get(f"{arch}.embedding_length") == 64
    assert f.has_tensor("output.weight") == (arch == "qwen2")
    assert f.has_tensor("blk.0.attn_q_norm.weight") == (arch == "qwen3")
    assert f.has_tensor("blk.0.attn_q.bias") == (arch == "qwen2")
    hf_t = load_file(str(hf / "model.safetensors"))
    q = f.tensor("blk.1.attn_q.weight").data
    k = f.tensor("blk.1.attn_k.weight").data
    if arch == "llama":  # rows permuted for interleaved rope; undoing it gives HF back
        q, k = unpermute_qk(q, 4), unpermute_qk(k, 2)
        assert not np.array_equal(f.tensor("blk.1.attn_q.weight").data, hf_t["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(q, hf_t["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(k, hf_t["model.layers.1.self_attn.k_proj.weight"])


def test_tokenizer_round_trip(target: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    from spekula.core.modelfile.tokenizer import Tokenizer

    out = tmp_path / "m.gguf"
    convert(target, out, outtype="f16")
    f = GGUFFile(out)
    assert f.get("tokenizer.ggml.pre") == "smollm" and f.get("tokenizer.ggml.model") == "gpt2"
    tokens = f.get("tokenizer.ggml.tokens")
    assert len(tokens) == tiny_hf.VOCAB and tokens[-1] == f"[PAD{tiny_hf.VOCAB - 1}]"
    assert f.get("tokenizer.ggml.token_type")[-1] == 5  # padding is UNUSED
    assert f.get("tokenizer.ggml.add_bos_token") is False
    assert "im_start" in f.get("tokenizer.chat_template")
    ours, theirs = Tokenizer.from_gguf(f), HFTokenizer.from_file(str(target / "tokenizer.json"))
    text = "The quick brown fox, 12345 times!\n  def f(x): return x <|im_end|>"
    assert ours.encode(text, add_special=False) == theirs.encode(text).ids
    assert f.tensor("token_embd.weight").type_name == "F16"


def test_named_pre_tokenizer_overrides_inference(target: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    convert(target, out, outtype="f32", pre="qwen2")
    assert GGUFFile(out).get("tokenizer.ggml.pre") == "qwen2"
    with pytest.raises(ConfigError, match="unknown --pre"):
        convert(target, tmp_path / "x.gguf", pre="nope")


def test_plain_target_matches_hf_through_torch_backend(target: Path, tmp_path: Path) -> None:
    import hf_reference as ref

    from spekula.core.backend import BackendOptions, Capture, SeqInput, load_backend

    out = tmp_path / "m.gguf"
    convert(target, out, outtype="f32")
    b = load_backend("torch", str(out), BackendOptions(n_ctx=64, n_seq_max=1))
    toks = [5, 17, 200, 33, 99, 120, 7, 8]
    res = b.forward([SeqInput(b.new_seq(), np.array(toks, np.int32), 0, np.arange(len(toks)))],
                    Capture(layers=frozenset({3, 8})))[0]
    logits, states = ref.target_forward(target, toks)
    np.testing.assert_allclose(res.logits, logits.numpy(), atol=1e-4)
    np.testing.assert_allclose(res.layer_inputs[3], states[3].numpy(), atol=1e-4)


def test_eagle3_keys_and_d2t(target: Path, tmp_path: Path) -> None:
    hf = tiny_hf.write_eagle3(tmp_path / "e3", layer_ids=None)
    out = tmp_path / "e3.gguf"
    convert(hf, out, outtype="bf16", target_dir=target)
    f = GGUFFile(out)
    assert f.architecture == "eagle3"
    assert list(f.get("eagle3.target_layers")) == [2, 4, 5]  # default [2, N//2, N-3] for N=8
    assert f.get("eagle3.target_hidden_size") == 64 and f.get("eagle3.block_count") == 1
    assert f.get("eagle3.vocab_size") == tiny_hf.VOCAB
    d2t = f.tensor("d2t")
    assert d2t.type_name == "I64"
    offsets = load_file(str(hf / "model.safetensors"))["d2t"]
    np.testing.assert_array_equal(np.asarray(d2t.data), offsets + np.arange(offsets.size))
    assert not f.has_tensor("t2d") and f.has_tensor("blk.0.attn_norm_2.weight")
    assert f.tensor("blk.0.attn_q.weight").type_name == "BF16"


def test_dflash_keys(target: Path, tmp_path: Path) -> None:
    out = tmp_path / "df.gguf"
    convert(tiny_hf.write_dflash(tmp_path / "df", markov_rank=8), out, outtype="f32", target_dir=target)
    f = GGUFFile(out)
    assert f.architecture == "dflash"
    assert list(f.get("dflash.target_layers")) == [2, 7]
    assert f.get("dflash.block_size") == 4 and f.get("tokenizer.ggml.mask_token_id") == tiny_hf.VOCAB - 1
    assert f.get("dflash.sample_from_anchor") is True and f.get("dflash.has_confidence_head") is True
    assert {"fc.weight", "enc.output_norm.weight", "markov_w1.weight", "markov_w2.weight", "conf_proj.weight",
            "conf_proj.bias", "blk.1.attn_k_norm.weight"} <= set(f.tensor_names())
    assert not f.has_tensor("output.weight")  # full draft vocabulary: the target head is used


# --- errors ------------------------------------------------------------------------------------------


def test_unknown_layout(tmp_path: Path) -> None:
    hf = tiny_hf.write_target(tmp_path / "hf", "llama", n_layer=1)
    edit_config(hf, architectures=["MambaForCausalLM"])
    with pytest.raises(ModelFileError, match="unknown checkpoint layout 'MambaForCausalLM'"):
        convert(hf, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no config.json"):
        convert(tmp_path, tmp_path / "x.gguf")
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelFileError, match="invalid JSON"):
        convert(tmp_path, tmp_path / "x.gguf")


def test_missing_tensor_leaves_no_file(tmp_path: Path) -> None:
    hf = tiny_hf.write_target(tmp_path / "hf", "qwen3", n_layer=2)
    edit_tensors(hf, drop=("model.layers.1.self_attn.k_norm.weight",))
    with pytest.raises(ModelFileError, match="k_norm"):
        convert(hf, tmp_path / "x.gguf")
    assert list(tmp_path.glob("x.gguf*")) == []


def test_draft_needs_target_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^an EAGLE-3 draft needs --target-model-dir"):
        convert(tiny_hf.write_eagle3(tmp_path / "e3"), tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="^a DFlash draft needs --target-model-dir"):
        convert(tiny_hf.write_dflash(tmp_path / "df"), tmp_path / "x.gguf")


@pytest.mark.parametrize("where", UNWRITABLE)
def test_unwritable_outfile_is_one_clear_error(tmp_path: Path, where: str) -> None:
    """A directory, or a path below a regular file: one ConfigError naming the path (the cleanup after
    the failed open used to raise NotADirectoryError over it), and nothing written anywhere."""
    hf = tiny_hf.write_target(tmp_path / "hf", "llama", n_layer=1)
    blocker, outfile, needle = unwritable_output(tmp_path, where, "x.gguf")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="--outfile") as info:
        convert(hf, outfile)
    assert needle in str(info.value) and str(outfile) in str(info.value)
    assert sorted(tmp_path.rglob("*")) == before
    if where != "directory":
        assert blocker.read_text() == "keep me"


def test_write_failure_is_a_config_error_and_cleanup_never_raises(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError while writing (here: the disk filling up) is reported as such, the temporary file is
    gone, and a cleanup that itself fails (the file vanished) does not replace that error."""
    import gguf

    hf = tiny_hf.write_target(tmp_path / "hf", "llama", n_layer=1)

    def full_disk(self: gguf.GGUFWriter) -> None:
        assert self.path is not None
        Path(self.path).unlink()  # so that the cleanup finds nothing to remove
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(ConfigError, match="cannot write --outfile .*x.gguf: No space left on device"):
        convert(hf, tmp_path / "x.gguf")
    assert list(tmp_path.glob("x.gguf*")) == []


def test_outfile_mode_follows_the_umask_and_parents_are_created(tmp_path: Path) -> None:
    hf = tiny_hf.write_target(tmp_path / "hf", "llama", n_layer=1)
    old = os.umask(0o027)
    try:
        _, path = convert(hf, tmp_path / "new" / "dir" / "x.gguf")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in path.parent.iterdir()] == ["x.gguf"]


def test_eagle3_shape_mismatch_with_target(target: Path, tmp_path: Path) -> None:
    hf = tiny_hf.write_eagle3(tmp_path / "e3")
    edit_config(hf, target_hidden_size=96)
    with pytest.raises(ModelFileError, match="target_hidden_size 96 differs from the hidden size 64 of the target"):
        convert(hf, tmp_path / "x.gguf", target_dir=target)


def test_eagle3_bad_layer_ids_and_d2t(target: Path, tmp_path: Path) -> None:
    hf = tiny_hf.write_eagle3(tmp_path / "e3", layer_ids=(1, 4, 9))
    with pytest.raises(ModelFileError, match="3 distinct target layer ids"):
        convert(hf, tmp_path / "x.gguf", target_dir=target)
    hf = tiny_hf.write_eagle3(tmp_path / "e3b")
    edit_tensors(hf, d2t=np.zeros(64, dtype=np.int64))  # offsets 0: draft id i is target id i (valid)
    convert(hf, tmp_path / "ok.gguf", target_dir=target)
    dup = np.zeros(64, dtype=np.int64)
    dup[1] = -1  # draft id 1 -> target id 0, same as draft id 0
    edit_tensors(hf, d2t=dup)
    with pytest.raises(ModelFileError, match="same target id"):
        convert(hf, tmp_path / "x.gguf", target_dir=target)


def test_dflash_hidden_mismatch(target: Path, tmp_path: Path) -> None:
    hf = tiny_hf.write_dflash(tmp_path / "df")
    other = tiny_hf.write_target(tmp_path / "t2", "qwen3", n_layer=8)
    edit_config(other, hidden_size=128)
    with pytest.raises(ModelFileError, match="hidden_size 64 != target hidden_size 128"):
        convert(hf, tmp_path / "x.gguf", target_dir=other)
    edit_config(hf, dflash_config={"mask_token_id": 5000, "target_layer_ids": [1, 6]})
    with pytest.raises(ModelFileError, match="mask_token_id"):
        convert(hf, tmp_path / "x.gguf", target_dir=target)


def test_cli_reports_errors_without_traceback(target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = tiny_hf.write_eagle3(tmp_path / "e3")
    rc = cli_main(["convert", str(hf), "--outfile", str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err
    assert rc == 1 and "spekula: error:" in err and "--target-model-dir" in err and "Traceback" not in err
    rc = cli_main(["convert", str(hf), "--target-model-dir", str(target), "--outtype", "f32",
                   "--outfile", str(tmp_path / "e3.gguf")])
    assert rc == 0 and GGUFFile(tmp_path / "e3.gguf").architecture == "eagle3"
    assert issubclass(ModelFileError, SpekulaError)


def _to_bf16_safetensors(path: Path) -> None:
    """Rewrite a float32 safetensors file as BF16 (numpy has no bfloat16, so by hand: truncate the bits)."""
    import struct

    t = load_file(str(path))
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    off = 0
    for name, arr in t.items():
        if arr.dtype == np.float32:
            raw, dtype = (arr.view(np.uint32) >> 16).astype("<u2").tobytes(), "BF16"
        else:
            raw, dtype = arr.tobytes(), {np.dtype(np.int64): "I64", np.dtype(bool): "BOOL"}[arr.dtype]
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_bf16_checkpoint_is_read_without_torch(target: Path, tmp_path: Path) -> None:
    hf = tiny_hf.write_eagle3(tmp_path / "e3")
    ref = load_file(str(hf / "model.safetensors"))
    _to_bf16_safetensors(hf / "model.safetensors")
    out = tmp_path / "e3.gguf"
    convert(hf, out, outtype="f32", target_dir=target)
    got = GGUFFile(out).tensor("fc.weight").data
    want = (ref["fc.weight"].view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(got, want)


def test_truncated_safetensors_is_a_clear_error(tmp_path: Path) -> None:
    hf = tiny_hf.write_target(tmp_path / "hf", "llama", n_layer=1)
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        convert(hf, tmp_path / "x.gguf")
