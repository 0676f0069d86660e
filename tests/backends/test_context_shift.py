"""Backend.shift (a server's --context-shift) on the native and torch backends.

With one block, a token's keys and values depend only on the token and its position, so after a shift
the cache must equal recomputing the shifted token sequence from scratch: the next rows' logits are
compared with a fresh sequence holding the kept tokens at their new positions (within float rounding:
the torch cache is float32, the native one float16, whose keys are rotated from their stored values and
rounded again, as llama.cpp's K-shift does; F32 weights, so that the native path's int8 activations do
not hide the shift's error). Both rope pairings (llama's interleaved pairs, qwen's
halves), qk-norm, biases and YaRN are covered. The same comparison with the kept keys left at their
old rotation fails, so the check sees the re-rope. Deeper models: the two backends agree after shifts.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from spekula.backends.context_shift import shift_refusal
from spekula.core.backend import Backend, BackendOptions, SeqInput, load_backend
from spekula.core.errors import ConfigError
from spekula.fixtures import tiny_hf
from spekula.fixtures.llamacpp_convert import llamacpp_convert
from spekula.fixtures.tiny_gguf import tiny_model_path

pytest.importorskip("torch")

# Logits of about 30 in magnitude: a float32 cache (torch), a float16 one (native: keys rotated from their
# stored values and rounded again, as llama.cpp's K-shift does; recomputation itself is that far from torch).
TOL = {"torch": 1e-4, "native": 0.1}
N_CTX = 128


@cache
def _yarn_model(root: Path) -> Path:
    hf = root / "hf-yarn"
    tiny_hf.write_target(hf, "llama", n_layer=1, tied=False)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(rope_theta=100.0, max_position_embeddings=64,
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    (hf / "config.json").write_text(json.dumps(cfg, indent=1))
    return llamacpp_convert(hf, root / "llama-yarn.gguf", "f32")


def _model(name: str, root: Path) -> Path:
    return _yarn_model(root) if name == "yarn" else tiny_model_path(name, n_layer=1, weight_type="F32")


def _logits(backend: Backend, seq: int, tokens: np.ndarray, start: int) -> np.ndarray:
    [out] = backend.forward([SeqInput(seq, tokens.astype(np.int32), start, logit_rows=np.arange(len(tokens)))])
    return out.logits


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("context-shift")


@pytest.mark.parametrize("name", ["native", "torch"])
@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3", "yarn"])
@pytest.mark.parametrize(("n_keep", "n_discard"), [(0, 20), (4, 17), (10, 1), (1, 38)])
def test_shifted_cache_equals_recomputation(name: str, model: str, n_keep: int, n_discard: int, out_dir: Path) -> None:
    backend = load_backend(name, str(_model(model, out_dir)), BackendOptions(n_ctx=N_CTX, n_seq_max=4))
    rng = np.random.default_rng(n_keep * 100 + n_discard)
    n_vocab = backend.info.n_vocab
    prompt, extra = rng.integers(0, n_vocab, 60), rng.integers(0, n_vocab, 6)
    seq = backend.new_seq()
    _logits(backend, seq, prompt, 0)
    backend.shift(seq, n_keep, n_discard)
    assert backend.seq_len(seq) == len(prompt) - n_discard
    kept = np.concatenate([prompt[:n_keep], prompt[n_keep + n_discard:]])
    got = _logits(backend, seq, extra, len(kept))
    ref_seq = backend.new_seq()
    want = _logits(backend, ref_seq, np.concatenate([kept, extra]), 0)[len(kept):]
    np.testing.assert_allclose(got, want, atol=TOL[name], rtol=0)
    # The shift changed what the rows see: the unshifted sequence gives other logits.
    assert n_discard == 0 or not np.allclose(got, _logits(backend, backend.new_seq(), np.concatenate([prompt, extra]), 0)[len(prompt):],
                                             atol=TOL[name])


def test_shifts_repeat_and_backends_agree_on_deeper_models() -> None:
    """Four blocks, three shifts in a row with rows appended between them: native and torch agree."""
    path = str(tiny_model_path("qwen3", n_layer=4, weight_type="F32"))
    rng = np.random.default_rng(5)
    shifts = ((3, 20, 10), (0, 15, 12), (8, 20, 5))
    prompt = rng.integers(0, 300, 50)
    chunks = [rng.integers(0, 300, new) for _, _, new in shifts]
    outs = {}
    for name in ("native", "torch"):
        b = load_backend(name, path, BackendOptions(n_ctx=64, n_seq_max=1))
        seq = b.new_seq()
        _logits(b, seq, prompt, 0)
        rows = []
        for (n_keep, n_discard, _), chunk in zip(shifts, chunks, strict=True):
            b.shift(seq, n_keep, n_discard)
            rows.append(_logits(b, seq, chunk, b.seq_len(seq)))
        outs[name] = np.concatenate(rows)
    np.testing.assert_allclose(outs["native"], outs["torch"], atol=0.2, rtol=0)


@pytest.mark.parametrize("name", ["native", "torch"])
def test_shift_bounds_are_checked(name: str) -> None:
    backend = load_backend(name, str(tiny_model_path("llama", n_layer=1, weight_type="F32")),
                           BackendOptions(n_ctx=64, n_seq_max=1))
    seq = backend.new_seq()
    _logits(backend, seq, np.arange(10), 0)
    for n_keep, n_discard in ((-1, 2), (2, -1), (5, 6)):
        with pytest.raises(ConfigError, match="context shift"):
            backend.shift(seq, n_keep, n_discard)
    assert backend.seq_len(seq) == 10
    backend.shift(seq, 3, 0)
    assert backend.seq_len(seq) == 10


def test_recurrent_and_sliding_models_refuse() -> None:
    hybrid = SimpleNamespace(arch="qwen35", is_hybrid=True, swa_layers=())
    sliding = SimpleNamespace(arch="gemma3", is_hybrid=False, swa_layers=(True, False))
    plain = SimpleNamespace(arch="llama", is_hybrid=False, swa_layers=())
    assert "qwen35" in str(shift_refusal(hybrid, "the native backend"))  # type: ignore[arg-type]
    assert "recurrent" in str(shift_refusal(hybrid, "the native backend"))  # type: ignore[arg-type]
    refusal = str(shift_refusal(sliding, "the torch backend"))  # type: ignore[arg-type]
    assert "gemma3" in refusal and "sliding-window" in refusal and "the torch backend" in refusal
    assert shift_refusal(plain, "the native backend") is None  # type: ignore[arg-type]


def test_onnx_refuses() -> None:
    pytest.importorskip("onnxruntime")
    from spekula.backends.onnx.backend import backend_class

    assert "context shift is not supported" in str(backend_class.context_shift_refusal(object()))  # type: ignore[arg-type]
