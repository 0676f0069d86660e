"""OnnxBackend on the tiny fixtures (and SmolLM2, slow): logits against transformers, exact-mode
bitwise invariance, batched mode within tolerance, hidden-state captures, clear errors."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest

from spekula.core.backend import BackendOptions, Capture, SeqInput
from spekula.core.errors import ConfigError, ModelFileError
from spekula.fixtures.tiny_gguf import ARCHS, hf_config_overrides, tiny_model_path

onnx_backend = pytest.importorskip("spekula.backends.onnx.backend")

from backend_helpers import chunked_logits  # noqa: E402

OnnxBackend = onnx_backend.OnnxBackend

# Batched mode (exact=False) pads sequences into one run; MLAS then takes other kernel paths for some
# rows. Observed differences on the fixtures are ~1e-5; this bound leaves room for other CPUs.
BATCH_TOL = 1e-4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPEKULA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "onnx-cache"))


def _backend(arch: str = "llama", **kw: object) -> OnnxBackend:
    return OnnxBackend(tiny_model_path(arch), BackendOptions(n_ctx=256, n_seq_max=4, threads=1, **kw))


def _tokens(n: int, seed: int = 0, n_vocab: int = 320) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def _hf_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **hf_config_overrides(path)
        )
    with torch.no_grad():
        return model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch: str) -> None:
    """An independent implementation (HF's, un-permuted rotate-half rope) agrees on every row."""
    be = _backend(arch)
    ids = _tokens(24, seed=1)
    seq = be.new_seq()
    ours = be.forward([SeqInput(seq, ids, 0, np.arange(len(ids)))])[0].logits
    ref = _hf_logits(tiny_model_path(arch), ids)
    assert ours.shape == ref.shape == (24, be.info.n_vocab)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_mode_is_bitwise_invariant_to_chunking_and_truncation(arch: str) -> None:
    be = _backend(arch)
    ids = _tokens(41, seed=2)
    seq = be.new_seq()
    whole = be.forward([SeqInput(seq, ids, 0, np.arange(41))])[0].logits
    be.truncate(seq, 0)
    assert np.array_equal(chunked_logits(be, seq, ids, (3, 1, 1, 9, 2, 25)), whole)
    # Truncate, then continue with different tokens, then go back to the original ones.
    be.truncate(seq, 20)
    assert be.seq_len(seq) == 20
    be.forward([SeqInput(seq, _tokens(5, seed=9), 20)])
    again = be.forward([SeqInput(seq, ids[20:30], 20, np.arange(10))])[0].logits
    assert np.array_equal(again, whole[20:30])
    assert be.seq_len(seq) == 30


def test_several_sequences_in_one_forward() -> None:
    exact = _backend()
    loose = _backend(exact=False)
    prompts = [_tokens(n, seed=n) for n in (17, 5, 30)]
    for be in (exact, loose):
        seqs = [be.new_seq() for _ in prompts]
        alone = []
        for s, p in zip(seqs, prompts, strict=True):
            be.forward([SeqInput(s, p[:-3], 0)])
            alone.append(be.forward([SeqInput(s, p[-3:], len(p) - 3, np.arange(3))])[0].logits)
            be.truncate(s, len(p) - 3)
        together = be.forward([SeqInput(s, p[-3:], len(p) - 3, np.arange(3)) for s, p in zip(seqs, prompts, strict=True)])
        for a, t in zip(alone, together, strict=True):
            if be.options.exact:
                assert np.array_equal(t.logits, a)
            else:
                np.testing.assert_allclose(t.logits, a, atol=BATCH_TOL, rtol=0)
        assert [be.seq_len(s) for s in seqs] == [len(p) for p in prompts]


@pytest.mark.parametrize("exact", [True, False])
def test_captures(exact: bool) -> None:
    be = _backend("qwen3", exact=exact)
    n_layer = be.info.n_layer
    a, b = be.new_seq(), be.new_seq()
    ids_a, ids_b = _tokens(6, seed=3), _tokens(4, seed=4)
    cap = Capture(frozenset({0, 2, n_layer}), final_norm=True)
    out_a, out_b = be.forward([SeqInput(a, ids_a, 0, np.arange(6)), SeqInput(b, ids_b, 0, np.arange(4))], cap)
    emb = be.export.path  # the embedding table is the Gather input: compare layer 0 with the GGUF rows
    from spekula.backends.gguf.weights import dequantize
    from spekula.core.modelfile.gguf_file import GGUFFile

    table = dequantize(GGUFFile(tiny_model_path("qwen3")).tensor("token_embd.weight"))
    assert emb.is_file()
    for out, ids in ((out_a, ids_a), (out_b, ids_b)):
        assert set(out.layer_inputs) == {0, 2, n_layer}
        assert all(v.shape == (len(ids), be.info.n_embd) for v in out.layer_inputs.values())
        assert np.array_equal(out.layer_inputs[0], table[ids])
        assert out.hidden_final is not None and out.hidden_final.shape == (len(ids), be.info.n_embd)
        # Tied output: logits are the final hidden state times the embedding table.
        np.testing.assert_allclose(out.hidden_final @ table.T, out.logits, atol=1e-4, rtol=0)
        assert not np.allclose(out.layer_inputs[2], out.layer_inputs[n_layer])
    plain = be.forward([SeqInput(a, ids_a[:1], 6)])[0]
    assert plain.layer_inputs == {} and plain.hidden_final is None


def test_logit_rows_none_and_empty() -> None:
    be = _backend()
    seq = be.new_seq()
    ids = _tokens(8)
    last = be.forward([SeqInput(seq, ids, 0)])[0].logits
    assert last.shape == (1, be.info.n_vocab)
    be.truncate(seq, 0)
    none = be.forward([SeqInput(seq, ids, 0, np.array([], dtype=np.int64))])[0].logits
    assert none.shape == (0, be.info.n_vocab)
    assert be.seq_len(seq) == 8
    be.truncate(seq, 0)
    assert np.array_equal(be.forward([SeqInput(seq, ids, 0, np.arange(8))])[0].logits[-1:], last)


def test_bad_inputs_are_clear_errors() -> None:
    be = _backend()
    seq = be.new_seq()
    be.forward([SeqInput(seq, _tokens(4), 0)])
    cases = [
        ([SeqInput(seq, np.array([320]), 4)], "token id"),
        ([SeqInput(seq, np.array([-1]), 4)], "token id"),
        ([SeqInput(seq, _tokens(2), 5)], "beyond its length"),
        ([SeqInput(seq, _tokens(1), 4), SeqInput(seq, _tokens(1), 4)], "twice"),
        ([SeqInput(99, _tokens(1), 0)], "unknown sequence"),
        ([SeqInput(seq, _tokens(300), 4)], "n_ctx"),
        ([SeqInput(seq, _tokens(2), 4, np.array([2]))], "logit rows"),
        ([SeqInput(seq, np.array([], dtype=np.int32), 4)], "at least one token"),
    ]
    for inputs, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            be.forward(inputs)
    with pytest.raises(ConfigError, match="capture layer"):
        be.forward([SeqInput(seq, _tokens(1), 4)], Capture(frozenset({be.info.n_layer + 1})))
    assert be.seq_len(seq) == 4  # nothing was written by the failed calls
    with pytest.raises(ConfigError, match="n_keep"):
        be.truncate(seq, -1)
    for _ in range(3):
        be.new_seq()
    with pytest.raises(ConfigError, match="n_seq_max"):
        be.new_seq()
    be.free_seq(seq)
    with pytest.raises(ConfigError, match="unknown sequence"):
        be.seq_len(seq)
    assert be.new_seq() == seq  # ids are reused


def test_bad_options_and_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dtype"):
        _backend(dtype="bf16")
    with pytest.raises(ConfigError, match="ORT provider"):
        _backend(ort_provider="tensorrt")
    # -c 0 / -np 0 name the option a user sets, not the field names n_ctx / n_seq_max.
    with pytest.raises(ConfigError, match=r"^context size \(-c/--ctx-size\) must be at least 1; got 0$"):
        OnnxBackend(tiny_model_path("llama"), BackendOptions(n_ctx=0))
    with pytest.raises(ConfigError, match=r"^number of sequences \(-np/--parallel\) must be at least 1; got -1$"):
        OnnxBackend(tiny_model_path("llama"), BackendOptions(n_seq_max=-1))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(tiny_model_path("llama").read_bytes()[:5000])
    with pytest.raises(ModelFileError):
        OnnxBackend(truncated, BackendOptions())
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelFileError):
        OnnxBackend(garbage, BackendOptions())
    with pytest.raises(ModelFileError, match="no such file"):
        OnnxBackend(tmp_path / "missing.gguf", BackendOptions())


def test_kv_grows_past_its_first_allocation() -> None:
    """Host caches start small and double; the prefix must survive every growth."""
    be = OnnxBackend(tiny_model_path("qwen2"), BackendOptions(n_ctx=1100, n_seq_max=1, threads=1))
    ids = _tokens(1030, seed=5)
    seq = be.new_seq()
    whole = be.forward([SeqInput(seq, ids, 0, np.arange(len(ids)))])[0].logits
    be.truncate(seq, 0)
    start, got = 0, []
    for size in (200, 100, 300, 430):
        got.append(be.forward([SeqInput(seq, ids[start : start + size], start, np.arange(size))])[0].logits)
        start += size
    assert np.array_equal(np.concatenate(got), whole)
    assert be.seq_len(seq) == 1030


def test_loose_options_replace() -> None:
    """`exact` is read per forward, so one backend can be compared in both modes."""
    be = _backend()
    be.options = dataclasses.replace(be.options, exact=False)
    a, b = be.new_seq(), be.new_seq()
    out = be.forward([SeqInput(a, _tokens(3), 0), SeqInput(b, _tokens(7, seed=1), 0)])
    assert [o.logits.shape for o in out] == [(1, 320), (1, 320)]


def test_close_releases_and_refuses() -> None:
    be = _backend()
    seq = be.new_seq()
    be.forward([SeqInput(seq, _tokens(3), 0)])
    be.close()
    with pytest.raises(ConfigError, match="closed"):
        be.new_seq()
    with pytest.raises(ConfigError):
        be.forward([SeqInput(seq, _tokens(1), 3)])
