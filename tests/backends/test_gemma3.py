"""Gemma 3 and sliding-window attention (backends/gguf/architecture.py, csrc/sk_swa.h): the tiny checkpoint
made by transformers' Gemma3ForCausalLM and converted by llama.cpp's converter (fixtures/tiny_gemma3.py)
reads as llama.cpp reads it, runs on the native and torch backends within today's tolerance of
transformers' fp32 forward and greedily identical to it, keeps its sliding blocks' keys in bounded rings
whose rollback stays exact, stays lossless under speculation, and malformed files are clear errors."""

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
    assert_lossless,
    check_greedy_matches,
    check_logits_match,
    check_partial_drafts_roll_back,
    check_random_prompt_lossless,
    check_rings_beyond_the_window,
)
from sliding_window_checks import edited as _edited
from sliding_window_checks import tokens as _tokens

from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.recipes import FEATURES
from spekula.core.backend import SeqInput
from spekula.core.errors import ConfigError, ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.params import SamplingParams
from spekula.fixtures import tiny_gemma3 as g3

NONE = np.array([], np.int64)


@pytest.fixture(scope="module")
def gguf() -> Path:
    return g3.tiny_gemma3_gguf_path()


def test_the_file_reads_as_llamacpp_reads_it(gguf: Path) -> None:
    hp = read_hparams(GGUFFile(gguf), implements=FEATURES)
    assert hp.swa_layers == (True,) * 5 + (False,)  # every 6th block global
    assert (hp.sliding_window, hp.rope_base, hp.rope_base_swa) == (g3.WINDOW, g3.ROPE_GLOBAL, g3.ROPE_SLIDING)
    assert hp.embd_scale == math.sqrt(64) and hp.attn_scale == 1 / math.sqrt(g3.HEAD_DIM)
    assert hp.post_norms and hp.geglu and hp.has_qk_norm and hp.tied_output and hp.rope_neox


@pytest.mark.parametrize("name", ["native", "torch"])
def test_logits_match_transformers(gguf: Path, name: str) -> None:
    check_logits_match(gguf, g3.reference_logits, name)


@pytest.mark.parametrize("name", ["native", "torch"])
def test_greedy_matches_transformers(gguf: Path, name: str) -> None:
    check_greedy_matches(gguf, g3.gemma3_model(g3.tiny_gemma3_hf_path()), name)


def test_rings_beyond_the_window_match_full_attention_with_the_window_mask(gguf: Path, small_rings: int) -> None:
    check_rings_beyond_the_window(gguf)


def test_rollback_in_a_wrapped_ring_is_exact_and_deeper_truncation_refused(gguf: Path, small_rings: int) -> None:
    b = _backend("native", gguf, n_ctx=1024)
    prompt, cont = _tokens(600, seed=4), _tokens(12, seed=5)
    s = b.new_seq()
    b.forward([SeqInput(s, prompt, 0, NONE)])
    check_partial_drafts_roll_back(b, s, cont, range(8))  # a draft of 8 rows, the first j + 1 accepted
    # The ring (256 rows) holds the window plus 16 rows: going back further than that is refused.
    assert b.restorable(s, 100) == 0 and b.restorable(s, 0) == 0
    with pytest.raises(ConfigError, match="truncate to 100"):
        b.truncate(s, 100)
    with pytest.raises(ConfigError, match="truncate to 300"):
        b.forward([SeqInput(s, cont[:2], 300)])
    b.truncate(s, 0)
    assert np.array_equal(b.forward([SeqInput(s, prompt[:40], 0, np.arange(40))])[0].logits,
                          _all_rows(b, prompt[:40]))


def test_snapshots_bring_back_a_window_the_ring_lost(gguf: Path, small_rings: int) -> None:
    b = _backend("native", gguf, n_ctx=1024)
    tokens = _tokens(900, seed=10)
    want = _all_rows(b, tokens)
    s = b.new_seq()
    for n in (300, 400, 500):  # three snapshots: the oldest (300) is dropped
        b.forward([SeqInput(s, tokens[n - 100 if n > 300 else 0 : n], n - 100 if n > 300 else 0, NONE)])
        b.snapshot(s)
    b.forward([SeqInput(s, tokens[500:850], 500, NONE)])  # the ring forgot everything before ~600
    assert [b.restorable(s, n) for n in (350, 450, 590, 700, 850)] == [0, 400, 500, 700, 850]
    b.truncate(s, 400)
    got = b.forward([SeqInput(s, tokens[400:900], 400, np.arange(500))])[0].logits
    assert np.array_equal(got, want[400:])
    assert b.restorable(s, 600) == 400  # the snapshot at 500 was of the rows the truncate dropped: gone
    b.truncate(s, 0)
    assert b.restorable(s, 400) == 0


def test_a_snapshot_is_copied_when_decoding_overwrites_its_window(gguf: Path, small_rings: int) -> None:
    """A snapshot is a promise kept by the rings until a forward is about to overwrite its window (sk_swa.h):
    one row at a time past that point, the copy is taken just before and brings the window back exactly."""
    b = _backend("native", gguf, n_ctx=1024)
    tokens = _tokens(420, seed=11)
    want = _all_rows(b, tokens)
    s = b.new_seq()
    b.forward([SeqInput(s, tokens[:100], 0, NONE)])
    b.snapshot(s)
    for p in range(100, 400):  # the ring (256 rows) drops position 93, the window's first, at 349
        b.forward([SeqInput(s, tokens[p : p + 1], p, NONE)])
        assert b.restorable(s, 100) == 100
    b.truncate(s, 100)
    got = b.forward([SeqInput(s, tokens[100:420], 100, np.arange(320))])[0].logits
    assert np.array_equal(got, want[100:])


def test_a_long_forward_is_bitwise_its_chunks(gguf: Path) -> None:
    """Sliding and global blocks in one 300-row forward (attention in waves of rows, the FFN in passes)
    give what chunks of 1, 64 and 235 rows give."""
    b = _backend("native", gguf)
    ids = np.random.default_rng(9).integers(0, b.info.n_vocab, 300).astype(np.int32)
    assert np.array_equal(_all_rows(b, ids, [1, 64, 235]), _all_rows(b, ids))


def test_q8_0_file_on_the_native_kernels_is_close_to_torch() -> None:
    path = g3.tiny_gemma3_gguf_path(type_name="Q8_0")
    tokens = _tokens(50, seed=6)
    want = _all_rows(_backend("torch", path), tokens)
    got = _all_rows(_backend("native", path), tokens)
    assert np.abs(got - want).max() < 0.1 * float(np.abs(want).max())


@pytest.mark.parametrize("types", [("ngram-simple",), ("draft-simple",)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_is_lossless(gguf: Path, small_rings: int, types: tuple[str, ...], temperature: float) -> None:
    segment = _tokens(9, seed=7).tolist()
    first = (segment * 40)[:330]  # repetitive: n-grams draft; longer than the ring's 256 rows
    prompts = [first, first + _tokens(5, seed=8).tolist()]
    assert_lossless(_backend("native", gguf, n_ctx=1024), gguf, types, prompts,
                    SamplingParams(temperature=temperature, seed=5), n_ctx=1024, n_predict=40)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segment=st.lists(st.integers(3, 299), min_size=2, max_size=10), repeats=st.integers(1, 45),
       types=st.lists(st.sampled_from(("ngram-simple", "ngram-map-k", "suffix", "draft-simple")), min_size=1,
                      max_size=3, unique=True),
       temperature=st.sampled_from([0.0, 0.0, 0.8]), seed=st.integers(0, 2**31 - 1))
def test_speculation_is_lossless_hypothesis(segment: list[int], repeats: int, types: list[str], temperature: float,
                                            seed: int) -> None:
    """Random prompts (up to ~450 tokens: past the 256-row rings of a 16-row cap) and drafter sets: the
    engine's tokens are plain decoding's."""
    check_random_prompt_lossless(g3.tiny_gemma3_gguf_path(), (segment * repeats)[:450], types, temperature, seed,
                                 n_predict=40)


@pytest.mark.parametrize(("edit", "message"), [
    ({"meta": {"gemma3.attention.sliding_window_pattern": [True, False]}},
     r"sliding_window_pattern must list one flag per block \(6\)"),
    ({"meta": {"gemma3.attention.sliding_window": -4}}, r"invalid gemma3\.attention\.sliding_window = -4"),
    ({"drop": ("blk.2.post_ffw_norm.weight",)}, r"missing tensor 'blk\.2\.post_ffw_norm\.weight'"),
    ({"meta": {"gemma3.attn_logit_softcapping": 50.0}}, r"attention logit soft-capping \(50\.0\)"),
])
@pytest.mark.parametrize("name", ["native", "torch"])
def test_malformed_files_are_clear_errors(gguf: Path, tmp_path: Path, edit: dict[str, Any], message: str,
                                          name: str) -> None:
    bad = _edited(gguf, tmp_path / "bad.gguf", **edit)
    with pytest.raises(ModelFileError, match=message):
        _backend(name, bad)


@pytest.mark.parametrize("name", ["native", "torch"])
def test_final_logit_soft_capping(gguf: Path, tmp_path: Path, name: str) -> None:
    capped = _edited(gguf, tmp_path / "cap.gguf", meta={"gemma3.final_logit_softcapping": 30.0})
    tokens = _tokens(20, seed=9)
    plain = _all_rows(_backend(name, gguf), tokens)
    got = _all_rows(_backend(name, capped), tokens)
    assert np.abs(got - 30.0 * np.tanh(plain / 30.0)).max() < 1e-4 and np.abs(got).max() < 30.0


def test_a_file_pattern_overrides_the_architecture_rule(gguf: Path, tmp_path: Path) -> None:
    flags = [True, False, True, False, True, False]
    hp = read_hparams(GGUFFile(_edited(gguf, tmp_path / "p.gguf", meta={"gemma3.attention.sliding_window_pattern":
                                                                         flags})), implements=FEATURES)
    assert hp.swa_layers == tuple(flags)
    hp = read_hparams(GGUFFile(_edited(gguf, tmp_path / "n.gguf", meta={"gemma3.attention.sliding_window_pattern": 3})),
                      implements=FEATURES)
    assert hp.swa_layers == (True, True, False, True, True, False)


def test_onnx_refuses_the_new_blocks_by_name(gguf: Path) -> None:
    with pytest.raises(ModelFileError, match=r"needs what the onnx backend does not implement: .*GELU-gated FFN.*"
                                             r"sliding-window attention"):
        read_hparams(GGUFFile(gguf), runtime="the onnx backend")
