"""Backend.export_seq / import_seq: a sequence's state leaves a backend and comes back bitwise, on every
layout (native f16 KV, native rings of sliding-window models, a hybrid's recurrent state, torch's KV in
every dtype); a state that does not fit changes nothing; a backend without export says so by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backend_helpers import open_backend, random_tokens
from slot_helpers import N_CTX, slot_model

from spekula.core.backend import Backend, BackendOptions, SeqInput, SeqState, load_backend
from spekula.core.errors import ConfigError


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_exported_state_gives_bitwise_the_same_next_logits(arch: str, backend: str) -> None:
    path, _ = slot_model(arch)
    a, b = open_backend(backend, path, n_ctx=N_CTX, n_seq=2, threads=1), open_backend(backend, path, n_ctx=N_CTX,
                                                                                       n_seq=2, threads=1)
    ids = random_tokens(40, 5, 3, 300)
    sa, sb = a.new_seq(), b.new_seq()
    a.forward([SeqInput(sa, ids[:37], 0)])
    b.import_seq(sb, a.export_seq(sa))
    assert b.seq_len(sb) == 37
    want = a.forward([SeqInput(sa, ids[37:], 37, np.arange(3))])[0].logits
    got = b.forward([SeqInput(sb, ids[37:], 37, np.arange(3))])[0].logits
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_torch_half_precision_kv_round_trips_as_its_bits(dtype: str) -> None:
    path, _ = slot_model("llama")
    opts = BackendOptions(n_ctx=N_CTX, n_seq_max=1, threads=1, dtype=dtype)
    a, b = load_backend("torch", path, opts), load_backend("torch", path, opts)
    ids = random_tokens(30, 2, 3, 300)
    sa, sb = a.new_seq(), b.new_seq()
    a.forward([SeqInput(sa, ids[:27], 0)])
    state = a.export_seq(sa)
    assert state.arrays["k"].dtype == np.uint16 and dtype.replace("f16", "float16") in a.seq_state_format
    b.import_seq(sb, state)
    want = a.forward([SeqInput(sa, ids[27:], 27, np.arange(3))])[0].logits
    np.testing.assert_array_equal(b.forward([SeqInput(sb, ids[27:], 27, np.arange(3))])[0].logits, want)


def _sliding_model(name: str) -> Path:
    if name == "gemma4":  # blocks reading other blocks' KV, and heads of two sizes
        from spekula.fixtures.tiny_gemma4 import tiny_gemma4_gguf_path

        return tiny_gemma4_gguf_path()
    if name == "gptoss":
        from spekula.fixtures.tiny_gptoss import tiny_gptoss_gguf_path

        return tiny_gptoss_gguf_path()
    from spekula.fixtures.tiny_gemma3 import tiny_gemma3_gguf_path

    return tiny_gemma3_gguf_path()


@pytest.mark.parametrize("model", ["gemma3", "gemma4", "gptoss"])
def test_native_sliding_rings_round_trip_after_they_wrapped(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from spekula.backends.native import backend as native_backend

    monkeypatch.setattr(native_backend, "SWA_ROW_CAP", 16)  # 256-row rings: 300 positions wrap them
    path = _sliding_model(model)
    a, b = open_backend("native", path, n_ctx=512, n_seq=1, threads=1), open_backend("native", path, n_ctx=512,
                                                                                      n_seq=1, threads=1)
    ids = random_tokens(310, 9, 3, 300)
    sa, sb = a.new_seq(), b.new_seq()
    for i in range(0, 300, 16):
        a.forward([SeqInput(sa, ids[i : min(i + 16, 300)], i)])
    state = a.export_seq(sa)
    b.import_seq(sb, state)
    want = a.forward([SeqInput(sa, ids[300:], 300, np.arange(10))])[0].logits
    got = b.forward([SeqInput(sb, ids[300:], 300, np.arange(10))])[0].logits
    np.testing.assert_array_equal(got, want)
    assert b.restorable(sb, 290) == a.restorable(sa, 290)  # the same window is still in the rings


def test_a_state_that_does_not_fit_changes_nothing() -> None:
    path, _ = slot_model("llama")
    be = open_backend("native", path, n_ctx=64, n_seq=1, threads=1)
    seq = be.new_seq()
    be.forward([SeqInput(seq, random_tokens(10, 1, 3, 300), 0)])
    state = be.export_seq(seq)
    bad = SeqState(state.length, {"kv": state.arrays["kv"][:-1]})
    with pytest.raises(ConfigError, match="kv"):
        be.import_seq(seq, bad)
    with pytest.raises(ConfigError, match="does not fit"):
        be.import_seq(seq, SeqState(65, state.arrays))
    assert be.seq_len(seq) == 10


def test_onnx_refuses_by_name() -> None:
    class NoState(Backend):  # what a backend without export/import says (the onnx backend inherits it)
        def new_seq(self) -> int: return 0
        def free_seq(self, seq_id: int) -> None: return None
        def seq_len(self, seq_id: int) -> int: return 0
        def truncate(self, seq_id: int, n_keep: int) -> None: return None
        def forward(self, inputs: Any, capture: Any = None) -> list[Any]: return []

    with pytest.raises(ConfigError, match="NoState backend cannot export"):
        NoState().export_seq(0)
    from spekula.backends.onnx.backend import backend_class

    assert backend_class.export_seq is Backend.export_seq and backend_class.import_seq is Backend.import_seq
