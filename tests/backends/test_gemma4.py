"""Gemma 4, dense (backends/gguf/block_layout.py): the tiny checkpoint made by transformers'
Gemma4ForCausalLM and converted by llama.cpp's converter (fixtures/tiny_gemma4.py) reads as llama.cpp
reads it (per-block head sizes, shared KV, per-layer inputs, proportional rope), runs within today's
tolerance of transformers' fp32 forward and greedily identical to it past the window, stays lossless
under speculation (the native sliding blocks' rings wrapping, the shared blocks reading them), and
malformed files are clear errors. The onnx backend refuses its blocks by name. The MoE variant and the
values-from-keys variant (global blocks without ``attn_v``, transformers' ``attention_k_eq_v`` as the 31B and
26B-A4B set it) are checked the same way, and the double-wide FFNs of the KV-sharing blocks (per-block
``feed_forward_length``) and the global blocks' fewer KV heads (per-block ``head_count_kv``). One file for the architecture and its variants: they share its helpers."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backend_helpers import fresh_logits as _all_rows
from backend_helpers import open_backend as _backend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sliding_window_checks import (
    LOGIT_TOL,
    NATIVE_REL_TOL,
    check_greedy_matches,
    check_logits_match,
    check_partial_drafts_roll_back,
    check_random_prompt_lossless,
    check_rings_beyond_the_window,
    engine_tokens,
)
from sliding_window_checks import edited as _edited
from sliding_window_checks import tokens as _tokens
from toy_backend import plain_decode

from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.recipes import FEATURES
from spekula.core.backend import Backend, BackendOptions, SeqInput, load_backend
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import SamplingParams
from spekula.fixtures import tiny_gemma4 as g4

RUNS = ["native", "torch"]


@pytest.fixture(scope="module")
def gguf() -> Path:
    return g4.tiny_gemma4_gguf_path()


def test_the_file_reads_as_llamacpp_reads_it(gguf: Path) -> None:
    hp = read_hparams(GGUFFile(gguf), implements=FEATURES)
    assert hp.swa_layers == tuple(t == "sliding_attention" for t in g4.LAYER_TYPES)
    assert [hp.block_head_dim(i) for i in range(hp.n_layer)] == [16, 16, 16, 32, 16, 32]
    assert (hp.n_rot, hp.n_rot_swa) == (g4.HEAD_DIM, g4.HEAD_DIM_SWA)  # global: whole head, rope_freqs unrotate
    assert hp.layout.kv_source == (0, 1, 2, 3, 2, 3)  # the shared blocks read the last sliding / global owner
    assert hp.layout.n_embd_per_layer == g4.N_EMBD_PER_LAYER and hp.layout.out_scale
    assert (hp.sliding_window, hp.rope_base, hp.rope_base_swa) == (g4.WINDOW, g4.ROPE_GLOBAL, g4.ROPE_SLIDING)
    assert hp.embd_scale == math.sqrt(64) and hp.attn_scale == 1.0 and hp.final_softcap == g4.SOFTCAP
    assert hp.post_norms and hp.geglu and hp.has_qk_norm and hp.recipe.value_norm and hp.tied_output


@pytest.mark.parametrize("name", RUNS)
def test_logits_match_transformers(gguf: Path, name: str) -> None:
    check_logits_match(gguf, g4.reference_logits, name)


@pytest.mark.parametrize("name", RUNS)
def test_greedy_matches_transformers(gguf: Path, name: str) -> None:
    check_greedy_matches(gguf, g4.gemma4_model(g4.tiny_gemma4_hf_path()), name)


@pytest.mark.parametrize("name", RUNS)
def test_chunked_and_decoded_rows_equal_one_pass(gguf: Path, name: str) -> None:
    b = _backend(name, gguf, n_ctx=256)
    tokens = _tokens(90, seed=3)  # the shared blocks read windows the owners wrote in earlier forwards
    want = _all_rows(b, tokens)
    s = b.new_seq()
    got = [b.forward([SeqInput(s, tokens[:30], 0, np.arange(30))])[0].logits]
    got += [b.forward([SeqInput(s, tokens[i : i + 1], i)])[0].logits for i in range(30, 40)]
    got += [b.forward([SeqInput(s, tokens[40:], 40, np.arange(50))])[0].logits]
    got_rows = np.concatenate(got)
    assert np.array_equal(got_rows, want) if name == "native" else np.abs(got_rows - want).max() < 1e-4


def test_rings_beyond_the_window_match_full_attention_with_the_window_mask(gguf: Path, small_rings: int) -> None:
    check_rings_beyond_the_window(gguf)


def test_rollback_and_snapshots_in_wrapped_rings_are_exact(gguf: Path, small_rings: int) -> None:
    b = _backend("native", gguf, n_ctx=1024)
    prompt, cont = _tokens(600, seed=4), _tokens(12, seed=5)
    L = prompt.size
    s = b.new_seq()
    b.forward([SeqInput(s, prompt, 0, np.array([], np.int64))])
    b.snapshot(s)
    want = check_partial_drafts_roll_back(b, s, cont, range(0, 8, 3))  # 8-row drafts, the first j + 1 accepted
    b.forward([SeqInput(s, _tokens(300, seed=11), L + cont.size, np.array([], np.int64))])  # the rings move on
    assert b.restorable(s, L) == L  # the snapshot's window (the rings hold it no longer)
    b.truncate(s, L)
    again = np.stack([b.forward([SeqInput(s, cont[i : i + 1], L + i)])[0].logits[0] for i in range(cont.size)])
    assert np.array_equal(again, want)


@pytest.mark.parametrize("name", RUNS)
def test_q8_0_file_is_close_to_f32(name: str, gguf: Path) -> None:
    tokens = _tokens(50, seed=6)
    want = _all_rows(_backend(name, gguf), tokens)
    got = _all_rows(_backend(name, g4.tiny_gemma4_gguf_path(type_name="Q8_0")), tokens)
    assert np.abs(got - want).max() < 0.1 * float(np.abs(want).max())


def _engine_output(b: Backend, tok: Tokenizer, path: Path, types: tuple[str, ...], prompt: list[int],
                   sampling: SamplingParams, n_ctx: int) -> list[int]:
    (tokens,) = engine_tokens(b, tok, path, types, [prompt], sampling, n_ctx, n_predict=30)
    return tokens


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segment=st.lists(st.integers(3, 299), min_size=2, max_size=10), repeats=st.integers(1, 20),
       types=st.lists(st.sampled_from(("ngram-simple", "ngram-map-k", "suffix", "draft-simple")), min_size=1,
                      max_size=3, unique=True),
       temperature=st.sampled_from([0.0, 0.0, 0.8]), seed=st.integers(0, 2**31 - 1))
def test_speculation_is_lossless_hypothesis(segment: list[int], repeats: int, types: list[str], temperature: float,
                                            seed: int) -> None:
    """Random prompts (up to ~300 tokens: past the native 256-row rings of a 16-row cap) and drafter sets:
    the engine's tokens are plain decoding's."""
    check_random_prompt_lossless(g4.tiny_gemma4_gguf_path(), (segment * repeats)[:300], types, temperature, seed,
                                 n_predict=30)


@pytest.mark.parametrize("types", [("ngram-simple",), ("draft-simple",)])
def test_speculation_is_lossless_on_exact_torch(gguf: Path, types: tuple[str, ...]) -> None:
    b = load_backend("torch", str(gguf), BackendOptions(n_ctx=512, n_seq_max=3, threads=2, exact=True))
    tok = Tokenizer.from_gguf(GGUFFile(gguf))
    prompt = (_tokens(7, seed=12).tolist() * 12)[:80]
    sampling = SamplingParams(temperature=0.8, seed=3)
    got = _engine_output(b, tok, gguf, types, prompt, sampling, 512)
    assert got == plain_decode(b, prompt, n_predict=30, sampling=sampling, seed=3, is_eog=lambda t: False,
                               n_ctx=512, ignore_eos=True)


@pytest.mark.parametrize("name", RUNS)
@pytest.mark.parametrize(("edit", "message"), [
    ({"drop": ("gemma4.attention.sliding_window_pattern",)},
     r"missing metadata key 'gemma4\.attention\.sliding_window_pattern'"),
    ({"meta": {"gemma4.attention.sliding_window_pattern": [True, True, True, True, False, False]}},
     r"inconsistent gemma4\.attention\.sliding_window_pattern: the shared KV of blocks 4\.\."),
    ({"meta": {"gemma4.attention.shared_kv_layers": 5}}, r"invalid gemma4\.attention\.shared_kv_layers = 5"),
    ({"meta": {"gemma4.attention.value_length_swa": 8}}, r"key_length_swa 16 != value_length_swa 8"),
    ({"meta": {"gemma4.attention.head_count_kv": [2, 2, 2, 3, 2, 3]}},
     r"invalid per-block head_count_kv \[2, 2, 2, 3, 2, 3\] for 4 heads"),
    ({"meta": {"gemma4.attention.head_count_kv": [2, 2, 2, 1, 2, 2]}}, r"inconsistent gemma4\.attention\.head_count_kv"),
    ({"meta": {"gemma4.feed_forward_length": [128, 128, 0, 128, 256, 256]}},
     r"invalid per-block 'feed_forward_length'"),
    ({"drop": ("per_layer_proj_norm.weight",)}, r"missing tensor 'per_layer_proj_norm\.weight'"),
    ({"drop": ("blk.2.proj.weight",)}, r"missing tensor 'blk\.2\.proj\.weight'"),
])
def test_malformed_files_are_clear_errors(gguf: Path, tmp_path: Path, edit: dict[str, Any], message: str,
                                          name: str) -> None:
    bad = _edited(gguf, tmp_path / "bad.gguf", **edit)
    with pytest.raises(ModelFileError, match=message):
        _backend(name, bad)


def test_onnx_refuses_the_blocks_by_name(gguf: Path) -> None:
    with pytest.raises(ModelFileError, match=r"needs what the onnx backend does not implement: .*per-layer token "
                                             r"embeddings.*value norms"):
        read_hparams(GGUFFile(gguf), runtime="the onnx backend")


# ---- the mixture-of-experts variant (the dense FFN beside the experts) ----------------------------------

MOE_RUNS = ["native", "torch"]


@pytest.fixture(scope="module")
def moe_gguf() -> Path:
    return g4.tiny_gemma4_gguf_path(moe=True)


def test_the_moe_file_reads_as_llamacpp_reads_it(moe_gguf: Path) -> None:
    hp = read_hparams(GGUFFile(moe_gguf), implements=FEATURES)
    assert hp.moe is not None and hp.moe.beside_dense and hp.n_ff == 128
    assert (hp.moe.n_expert, hp.moe.n_expert_used, hp.moe.n_ff_exp) == (g4.N_EXPERT, g4.N_EXPERT_USED, g4.N_FF_EXP)
    assert (hp.moe.gating, hp.moe.norm_weights, hp.moe.activation) == ("softmax", True, "geglu")
    assert not hp.layout.kv_source and not hp.layout.n_embd_per_layer


@pytest.mark.parametrize("name", MOE_RUNS)
def test_moe_logits_and_greedy_match_transformers(moe_gguf: Path, name: str) -> None:
    import torch

    tokens = _tokens(60, seed=13)
    b = _backend(name, moe_gguf)
    want_rows = g4.reference_logits(tokens, moe=True)
    tol = LOGIT_TOL if name == "torch" else NATIVE_REL_TOL * float(np.abs(want_rows).max())
    assert np.abs(_all_rows(b, tokens) - want_rows).max() < tol
    ids = _tokens(12, seed=14).tolist()
    got = plain_decode(b, ids, n_predict=30, sampling=SamplingParams(temperature=0.0), seed=0,
                       is_eog=lambda t: False, n_ctx=512, ignore_eos=True)
    model = g4.gemma4_model(g4.tiny_gemma4_hf_path(moe=True))
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids):].tolist()
    assert got == want


@pytest.mark.parametrize("name", MOE_RUNS)
def test_moe_q8_0_file_is_close_to_f32(moe_gguf: Path, name: str) -> None:
    tokens = _tokens(50, seed=15)
    want = _all_rows(_backend(name, moe_gguf), tokens)
    got = _all_rows(_backend(name, g4.tiny_gemma4_gguf_path(moe=True, type_name="Q8_0")), tokens)
    assert np.abs(got - want).max() < 0.1 * float(np.abs(want).max())


@pytest.mark.parametrize("name", MOE_RUNS)
def test_moe_speculation_is_lossless(moe_gguf: Path, name: str) -> None:
    b = load_backend(name, str(moe_gguf), BackendOptions(n_ctx=512, n_seq_max=3, threads=2, exact=True))
    tok = Tokenizer.from_gguf(GGUFFile(moe_gguf))
    prompt = (_tokens(6, seed=16).tolist() * 15)[:80]
    sampling = SamplingParams(temperature=0.8, seed=4)
    got = _engine_output(b, tok, moe_gguf, ("ngram-simple", "draft-simple"), prompt, sampling, 512)
    assert got == plain_decode(b, prompt, n_predict=30, sampling=sampling, seed=4, is_eog=lambda t: False,
                               n_ctx=512, ignore_eos=True)


@pytest.mark.parametrize(("edit", "message"), [
    ({"drop": ("blk.1.pre_ffw_norm_2.weight",)}, r"missing tensor 'blk\.1\.pre_ffw_norm_2\.weight'"),
    ({"drop": ("blk.0.ffn_gate_inp.scale",)}, r"missing tensor 'blk\.0\.ffn_gate_inp\.scale'"),
    ({"meta": {"gemma4.expert_used_count": 9}}, r"invalid expert counts"),
    ({"drop": ("blk.2.ffn_gate_up_exps.weight",)}, r"missing tensor 'blk\.2\.ffn_gate_exps\.weight'"),
])
@pytest.mark.parametrize("name", MOE_RUNS)
def test_malformed_moe_files_are_clear_errors(moe_gguf: Path, tmp_path: Path, edit: dict[str, Any],
                                              message: str, name: str) -> None:
    with pytest.raises(ModelFileError, match=message):
        _backend(name, _edited(moe_gguf, tmp_path / "bad.gguf", **edit))


def test_onnx_refuses_the_moe_blocks_by_name(moe_gguf: Path) -> None:
    with pytest.raises(ModelFileError, match=r"needs what the onnx backend does not implement: .*a dense FFN beside "
                                             r"the experts"):
        read_hparams(GGUFFile(moe_gguf), runtime="the onnx backend")


# Values from keys: fixtures/tiny_gemma4.py's k_eq_v variant


@pytest.fixture(scope="module")
def kv_gguf() -> Path:
    return g4.tiny_gemma4_gguf_path(k_eq_v=True)


def test_the_global_owners_take_values_from_keys(kv_gguf: Path) -> None:
    f = GGUFFile(kv_gguf)
    hp = read_hparams(f, implements=FEATURES)
    global_owners = tuple(i for i in range(hp.n_layer) if not hp.swa_layers[i] and hp.layout.owns_kv(i))
    assert global_owners == (3,) and hp.layout.values_from_keys == global_owners
    assert not f.has_tensor("blk.3.attn_v.weight") and f.has_tensor("blk.2.attn_v.weight")


def _check_variant_matches_transformers(gguf: Path, name: str, seed: int, **variant: Any) -> None:
    """A variant's logits (60 rows, past the window) within today's tolerance of transformers', and its
    greedy continuation transformers' generate()."""
    import torch

    tokens = _tokens(60, seed=seed)
    want = g4.reference_logits(tokens, **variant)
    b = _backend(name, gguf)
    tol = LOGIT_TOL if name == "torch" else NATIVE_REL_TOL * float(np.abs(want).max())
    assert np.abs(_all_rows(b, tokens) - want).max() < tol

    ids = _tokens(12, seed=seed + 1).tolist()
    model = g4.gemma4_model(g4.tiny_gemma4_hf_path(**variant))
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids):].tolist()
    got = plain_decode(b, ids, n_predict=30, sampling=SamplingParams(temperature=0.0), seed=0,
                       is_eog=lambda t: False, n_ctx=512, ignore_eos=True)
    assert got == ref


def _check_chunked_rows_equal_one_pass(gguf: Path, name: str, seed: int) -> None:
    b = _backend(name, gguf, n_ctx=256)
    tokens = _tokens(70, seed=seed)
    want = _all_rows(b, tokens)
    s = b.new_seq()
    got = [b.forward([SeqInput(s, tokens[:25], 0, np.arange(25))])[0].logits]
    got += [b.forward([SeqInput(s, tokens[i : i + 1], i)])[0].logits for i in range(25, 35)]
    got += [b.forward([SeqInput(s, tokens[35:], 35, np.arange(35))])[0].logits]
    got_rows = np.concatenate(got)
    assert np.array_equal(got_rows, want) if name == "native" else np.abs(got_rows - want).max() < 1e-4


def _check_lossless(gguf: Path, name: str, types: tuple[str, ...], prompt_seed: int, seed: int) -> None:
    b = load_backend(name, str(gguf), BackendOptions(n_ctx=512, n_seq_max=3, threads=2, exact=True))
    tok = Tokenizer.from_gguf(GGUFFile(gguf))
    prompt = (_tokens(6, seed=prompt_seed).tolist() * 12)[:70]
    sampling = SamplingParams(temperature=0.8, seed=seed)
    got = _engine_output(b, tok, gguf, types, prompt, sampling, 512)
    assert got == plain_decode(b, prompt, n_predict=30, sampling=sampling, seed=seed, is_eog=lambda t: False,
                               n_ctx=512, ignore_eos=True)


@pytest.mark.parametrize("name", RUNS)
def test_values_from_keys_match_transformers(kv_gguf: Path, name: str) -> None:
    # seeds 21, 22: past the window of 8, the shared global block reads block 3's values
    _check_variant_matches_transformers(kv_gguf, name, 21, k_eq_v=True)


@pytest.mark.parametrize("name", RUNS)
def test_values_from_keys_chunked_rows_equal_one_pass(kv_gguf: Path, name: str) -> None:
    _check_chunked_rows_equal_one_pass(kv_gguf, name, 23)


@pytest.mark.parametrize("name", RUNS)
def test_values_from_keys_speculation_is_lossless(kv_gguf: Path, name: str) -> None:
    _check_lossless(kv_gguf, name, ("ngram-simple", "draft-simple"), 24, 5)


# Double-wide FFNs: fixtures/tiny_gemma4.py's double_wide variant (per-block feed_forward_length)


@pytest.fixture(scope="module")
def dw_gguf() -> Path:
    return g4.tiny_gemma4_gguf_path(double_wide=True)


@pytest.mark.parametrize("name", RUNS)
def test_double_wide_ffns_match_transformers(dw_gguf: Path, name: str) -> None:
    hp = read_hparams(GGUFFile(dw_gguf), implements=FEATURES)
    assert [hp.block_n_ff(i) for i in range(hp.n_layer)] == [128] * 4 + [256] * 2 and hp.n_ff == 256
    tokens = _tokens(60, seed=25)
    want = g4.reference_logits(tokens, double_wide=True)
    b = _backend(name, dw_gguf)
    tol = LOGIT_TOL if name == "torch" else NATIVE_REL_TOL * float(np.abs(want).max())
    assert np.abs(_all_rows(b, tokens) - want).max() < tol
    prompt = (_tokens(6, seed=26).tolist() * 12)[:70]
    sampling = SamplingParams(temperature=0.8, seed=7)
    exact = load_backend(name, str(dw_gguf), BackendOptions(n_ctx=512, n_seq_max=3, threads=2, exact=True))
    got = _engine_output(exact, Tokenizer.from_gguf(GGUFFile(dw_gguf)), dw_gguf, ("ngram-simple", "draft-simple"),
                         prompt, sampling, 512)
    assert got == plain_decode(exact, prompt, n_predict=30, sampling=sampling, seed=7, is_eog=lambda t: False,
                               n_ctx=512, ignore_eos=True)


# Fewer KV heads in the global blocks: fixtures/tiny_gemma4.py's global_kv_heads variant (per-block head_count_kv)


@pytest.fixture(scope="module")
def gkv_gguf() -> Path:
    return g4.tiny_gemma4_gguf_path(global_kv_heads=1)


def test_global_blocks_read_their_own_kv_head_count(gkv_gguf: Path) -> None:
    f = GGUFFile(gkv_gguf)
    assert f.get("gemma4.attention.head_count_kv") == [2, 2, 2, 1, 2, 1]  # the converter's per-block array
    hp = read_hparams(f, implements=FEATURES)
    assert [hp.block_n_head_kv(i) for i in range(hp.n_layer)] == [2, 2, 2, 1, 2, 1] and hp.n_head_kv == 2
    assert hp.layout.kv_of(5) == 3 and f.tensor("blk.3.attn_k.weight").shape[0] == 1 * g4.HEAD_DIM


@pytest.mark.parametrize("name", RUNS)
def test_global_kv_heads_match_transformers(gkv_gguf: Path, name: str) -> None:
    # seeds 27, 28: past the window, the shared global block reads block 3's one KV head
    _check_variant_matches_transformers(gkv_gguf, name, 27, global_kv_heads=1)


@pytest.mark.parametrize("name", RUNS)
def test_global_kv_heads_chunked_rows_equal_one_pass(gkv_gguf: Path, name: str) -> None:
    _check_chunked_rows_equal_one_pass(gkv_gguf, name, 29)


@pytest.mark.parametrize("name", RUNS)
def test_global_kv_heads_speculation_is_lossless(gkv_gguf: Path, name: str) -> None:
    _check_lossless(gkv_gguf, name, ("draft-simple",), 30, 9)
