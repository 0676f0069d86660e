"""The tiny GGUF fixtures: deterministic, laid out per docs/model-formats.md §1.2, loadable by transformers,
and not degenerate (greedy continuations vary)."""

from __future__ import annotations

import functools
import hashlib
import itertools
import multiprocessing
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest

from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import CONTROL, NORMAL, Tokenizer
from spekula.fixtures.bpe_train import train_byte_bpe
from spekula.fixtures.corpus import CORPUS
from spekula.fixtures.tiny_gguf import (
    ARCHS,
    build,
    hf_config_overrides,
    llama_permute,
    tiny_model_path,
    write_gguf,
)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = build("qwen3", tmp_path / "a.gguf", seed=3)
    b = build("qwen3", tmp_path / "b.gguf", seed=3)
    c = build("qwen3", tmp_path / "c.gguf", seed=4)
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]  # no temp leftovers


def test_bpe_trainer_is_deterministic_and_complete() -> None:
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    first = train_byte_bpe(CORPUS, pre, 400)
    assert first == train_byte_bpe(CORPUS, pre, 400)
    symbols, merges = first
    assert len(symbols) == 400 and len(set(symbols)) == 400
    assert all(a + b in symbols for a, b in merges)


def test_parallel_builds_do_not_collide(tmp_path: Path) -> None:
    target = str(tmp_path / "same.gguf")
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        # build itself goes to the workers (a test-module function would need `tests` importable there)
        pool.map(functools.partial(build, "llama"), [target, target])
    GGUFFile(target)  # complete and readable
    assert [p.name for p in tmp_path.iterdir()] == ["same.gguf"]


def test_tiny_model_path_caches() -> None:
    p = tiny_model_path("llama")
    mtime = p.stat().st_mtime_ns
    assert tiny_model_path("llama") == p and p.stat().st_mtime_ns == mtime
    assert tiny_model_path("llama", n_layer=8) != p
    with pytest.raises(ValueError, match="unknown fixture arch"):
        tiny_model_path("gpt-neox")


@pytest.mark.parametrize("arch", ARCHS)
def test_layout(arch: str) -> None:
    f = GGUFFile(tiny_model_path(arch))
    assert f.architecture == arch
    assert f.get(f"{arch}.block_count") == 4
    assert f.get(f"{arch}.embedding_length") == 64
    assert f.get(f"{arch}.attention.head_count") == 4
    assert f.get(f"{arch}.attention.head_count_kv") == 2
    assert not f.has_tensor("output.weight")  # tied
    shapes = {t.name: t.shape for t in f.tensors()}
    types = {t.name: t.type_name for t in f.tensors()}
    assert shapes["token_embd.weight"] == (320, 64)
    assert shapes["blk.0.attn_q.weight"] == (64, 64)
    assert shapes["blk.0.attn_k.weight"] == (32, 64)
    assert shapes["blk.0.ffn_down.weight"] == (64, 128)
    assert {"F32", "F16", "Q8_0"} <= set(types.values())
    assert f.has_tensor("blk.3.attn_q.bias") == (arch == "qwen2")
    assert f.has_tensor("blk.3.attn_q_norm.weight") == (arch == "qwen3")
    assert f.get("tokenizer.ggml.pre") == ("smollm" if arch == "llama" else "qwen2")
    types_tok = f.get("tokenizer.ggml.token_type")
    assert types_tok[:3] == [CONTROL] * 3 and set(types_tok[3:]) == {NORMAL}
    assert f.get("tokenizer.ggml.tokens")[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_llama_permutation_is_the_converter_order() -> None:
    n_head, hd = 2, 8
    w = np.arange(n_head * hd, dtype=np.float32)[:, None]
    perm = llama_permute(w, n_head)[:, 0].astype(int).tolist()
    assert perm[:hd] == [0, 4, 1, 5, 2, 6, 3, 7]  # rows 0, hd/2, 1, hd/2+1, ... per head
    assert perm[hd:] == [8, 12, 9, 13, 10, 14, 11, 15]


def test_write_gguf_types(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    p = write_gguf(
        tmp_path / "x.gguf",
        "eagle3",
        {"block_count": 1, "target_layers": [2, 4, 5], "norm_before_residual": True, "rope.freq_base": 1e4},
        {"w_f32": w, "w_q8": (w, "Q8_0"), "w_f16": (w, "F16"), "d2t": np.arange(5, dtype=np.int64)},
        {"general.name": "t"},
    )
    f = GGUFFile(p)
    assert f.get("eagle3.target_layers") == [2, 4, 5]
    assert f.get("eagle3.norm_before_residual") is True
    assert f.get("eagle3.rope.freq_base") == pytest.approx(1e4)
    assert f.tensor("w_q8").type_name == "Q8_0" and f.tensor("w_q8").shape == (8, 64)
    assert f.tensor("w_f16").type_name == "F16"
    assert f.tensor("d2t").type_name == "I64"
    deq = gguf.quants.dequantize(f.tensor("w_q8").data, gguf.GGMLQuantizationType.Q8_0)
    assert np.abs(deq - w).max() < 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_greedy_varies(arch: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    path = tiny_model_path(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **hf_config_overrides(path)
        )
    tok = Tokenizer.from_gguf(GGUFFile(path))
    prompts = ["The quick brown fox", "def f(x):\n", "<|im_start|>user\nWhat is two plus two?<|im_end|>\n"]
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0
            )
        gen = out[0, ids.shape[1] :].tolist()
        longest_run = max(sum(1 for _ in g) for _, g in itertools.groupby(gen))
        assert len(set(gen)) >= 8, (prompt, gen)
        assert longest_run <= 6, (prompt, gen)
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        assert float(logits.std()) > 1.0  # spread out, not a flat distribution
