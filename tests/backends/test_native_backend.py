"""Native backend on fixtures with every matrix in each block type it reads, and on SmolLM2.

Exactness is bitwise (chunking, batching with other sequences, thread count); closeness to the fp32
dequantized torch reference is relative (int8 activations, float16 KV cache: see NATIVE_REL_TOL).
"""

from __future__ import annotations

import resource
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from backend_conformance import NATIVE_REL_TOL, smollm2_path
from backend_helpers import fresh_logits, native_kernels, native_simd_choices
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spekula.backends.native import lib as nl
from spekula.backends.native.backend import NativeBackend
from spekula.core.backend import BackendOptions, Capture, SeqInput, load_backend
from spekula.core.errors import ConfigError, ModelFileError
from spekula.fixtures.tiny_gguf import tiny_model_path

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K", "Q2_K")
ARCH_OF = {t: ("llama", "qwen2", "qwen3")[i % 3] for i, t in enumerate(TYPES)}
HYP = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
KERNELS = native_simd_choices()


@cache
def native(type_name: str, threads: int = 1, kernels: str = "best") -> NativeBackend:
    path = tiny_model_path(ARCH_OF[type_name], weight_type=type_name)
    with native_kernels(kernels):
        return NativeBackend(str(path), BackendOptions(n_ctx=512, n_seq_max=4, threads=threads))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("type_name", TYPES)
def test_logits_near_the_fp32_reference(type_name: str, kernels: str) -> None:
    b = native(type_name, kernels=kernels)
    path = tiny_model_path(ARCH_OF[type_name], weight_type=type_name)
    ref = load_backend("torch", str(path), BackendOptions(n_ctx=256, n_seq_max=1, threads=1))
    tokens = np.random.default_rng(1).integers(0, b.info.n_vocab, 40).astype(np.int32)
    got = fresh_logits(b, tokens)
    s = ref.new_seq()
    want = ref.forward([SeqInput(s, tokens, 0, np.arange(40))])[0].logits
    # Every matrix here is quantized, the embedding and the head included: 1.5x the suite's tolerance.
    assert np.abs(got - want).max() <= 1.5 * NATIVE_REL_TOL * np.abs(want).max()
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.8


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("type_name", TYPES)
@HYP
@given(data=st.data())
def test_chunking_and_batching_are_bitwise_invariant(type_name: str, kernels: str, data: st.DataObject) -> None:
    b = native(type_name, kernels=kernels)
    n = data.draw(st.integers(2, 60), label="n")
    tokens = np.asarray(data.draw(st.lists(st.integers(0, b.info.n_vocab - 1), min_size=n, max_size=n)), np.int32)
    whole = fresh_logits(b, tokens)
    cuts, left = [], n
    while left:
        c = data.draw(st.integers(1, left), label="chunk")
        cuts.append(c)
        left -= c
    assert np.array_equal(fresh_logits(b, tokens, cuts), whole)
    other = np.asarray(data.draw(st.lists(st.integers(0, b.info.n_vocab - 1), min_size=1, max_size=30)), np.int32)
    s, o = b.new_seq(), b.new_seq()
    try:
        outs = b.forward([SeqInput(o, other, 0, np.arange(other.size)), SeqInput(s, tokens, 0, np.arange(n))])
        assert np.array_equal(outs[1].logits, whole)
    finally:
        b.free_seq(s)
        b.free_seq(o)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K"])
def test_long_forwards_are_bitwise_their_chunks(type_name: str, threads: int) -> None:
    """A long forward runs its attention in waves of rows and its FFN in passes of rows (csrc/sk_model.c):
    300 rows at once, whose later rows read two key chunks, give what chunks of 1, 37 and 50 rows give."""
    b = native(type_name, threads)
    tokens = np.random.default_rng(5).integers(0, b.info.n_vocab, 300).astype(np.int32)
    whole = fresh_logits(b, tokens)
    assert np.array_equal(fresh_logits(b, tokens, [1, 37, 50, 50, 50, 50, 50, 12]), whole)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q6_K"])
def test_thread_count_does_not_change_a_bit(type_name: str, kernels: str) -> None:
    tokens = np.random.default_rng(2).integers(0, 320, 33).astype(np.int32)
    one, two = native(type_name, 1, kernels), native(type_name, 2, kernels)
    assert one.kernels == two.kernels == nl.kernel_name(kernels)
    assert np.array_equal(fresh_logits(one, tokens), fresh_logits(two, tokens))


SIMD_SETS = [k for k in nl.available_kernels() if k != "generic"]


@pytest.mark.parametrize("type_name", TYPES)
def test_the_simd_sets_compute_the_same_model(type_name: str) -> None:
    """AVX2 and AVX-512 give the same logits to the bit, whole forwards included (norms, attention,
    activations): a model answers the same on every x86-64 machine with either set."""
    if len(SIMD_SETS) < 2:
        pytest.skip(f"this CPU runs one SIMD kernel set ({', '.join(SIMD_SETS) or 'none'}): nothing to compare")
    tokens = np.random.default_rng(3).integers(0, 320, 300).astype(np.int32)  # 300 keys: two attention chunks
    best, avx2 = native(type_name), native(type_name, kernels="avx2")
    assert best.kernels != avx2.kernels
    assert np.array_equal(fresh_logits(best, tokens, [200, 1, 99]), fresh_logits(avx2, tokens, [200, 1, 99]))


def test_an_unknown_kernel_choice_is_a_clear_error() -> None:
    with native_kernels("avx9000"), pytest.raises(ConfigError, match="SPEKULA_NATIVE_KERNELS|unknown native kernel"):
        NativeBackend(str(tiny_model_path("llama", weight_type="Q4_1")), BackendOptions(n_ctx=64, n_seq_max=1))


def test_capture_rows_split_per_sequence() -> None:
    b = native("Q8_0")
    cap = Capture(frozenset({0, b.info.n_layer}), final_norm=True)
    a_tok, b_tok = np.arange(5, 12, dtype=np.int32), np.arange(40, 43, dtype=np.int32)
    sa, sb = b.new_seq(), b.new_seq()
    try:
        both = b.forward([SeqInput(sa, a_tok, 0), SeqInput(sb, b_tok, 0)], cap)
        b.truncate(sa, 0)
        alone = b.forward([SeqInput(sa, a_tok, 0)], cap)[0]
        assert both[1].layer_inputs[0].shape == (3, b.info.n_embd)
        for layer in cap.layers:
            assert np.array_equal(both[0].layer_inputs[layer], alone.layer_inputs[layer])
        assert both[0].hidden_final is not None and alone.hidden_final is not None
        assert np.array_equal(both[0].hidden_final, alone.hidden_final)
    finally:
        b.free_seq(sa)
        b.free_seq(sb)


def test_options_it_cannot_honour_are_clear_errors() -> None:
    path = str(tiny_model_path("llama"))
    with pytest.raises(ConfigError, match="CPU only"):
        NativeBackend(path, BackendOptions(device="cuda"))
    with pytest.raises(ConfigError, match="block types"):
        NativeBackend(path, BackendOptions(dtype="bf16"))
    with pytest.raises(ConfigError, match="ctx-size up to"):
        NativeBackend(path, BackendOptions(n_ctx=10**12, n_seq_max=1))
    b = NativeBackend(path, BackendOptions(n_ctx=64, n_seq_max=1))
    b.new_seq()
    with pytest.raises(ConfigError, match="too many live sequences"):
        b.new_seq()
    b.close()
    with pytest.raises(ConfigError, match="closed"):
        b.forward([])


def test_a_tensor_type_without_kernel_is_named(tmp_path: Path) -> None:
    from spekula.fixtures.tiny_gguf import build

    src = build("llama", tmp_path / "m.gguf", quantize=False)
    data = bytearray(src.read_bytes())
    from spekula.core.modelfile.gguf_file import GGUFFile

    # Relabel one F32 tensor as I32 (a type with no matmul kernel) in the tensor directory.
    f = GGUFFile(src)
    name = "blk.0.ffn_up.weight"
    info = f._infos[name]
    needle = name.encode()
    at = data.index(needle) + len(needle)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at : type_at + 4], "little") == info.type_id == 0
    data[type_at : type_at + 4] = (26).to_bytes(4, "little")  # I32: same size per element as F32
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"blk\.0\.ffn_up\.weight.*I32"):
        NativeBackend(str(bad), BackendOptions(n_ctx=64, n_seq_max=1))


@pytest.mark.slow
def test_smollm2_keeps_weights_in_their_blocks() -> None:
    """No float copy of any matmul weight: loading adds about the file's size to resident memory."""
    path = smollm2_path()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    b = NativeBackend(str(path), BackendOptions(n_ctx=512, n_seq_max=1))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    size = path.stat().st_size
    assert grown < 1.3 * size, f"loading grew the peak RSS by {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"
    s = b.new_seq()
    out = b.forward([SeqInput(s, np.array([1, 504, 3458], np.int32), 0)])[0].logits
    assert out.shape == (1, b.info.n_vocab) and np.isfinite(out).all()
    b.close()


def test_the_head_packed_after_the_load_gate_gives_the_same_bits() -> None:
    """`before_head` runs once, in the load, before the output head is packed (build_engine waits there for
    the tokenizer); the head packed then is the one packed with the other weights, bit for bit."""
    path = str(tiny_model_path("llama", weight_type="Q4_K"))
    calls: list[int] = []
    gated = NativeBackend(path, BackendOptions(n_ctx=512, n_seq_max=1, threads=1, before_head=lambda: calls.append(1)))
    plain = NativeBackend(path, BackendOptions(n_ctx=512, n_seq_max=1, threads=1))
    assert calls == [1]
    packed = nl.lib().sk_ctx_packed_bytes
    assert packed(gated.context) == packed(plain.context) > 0
    tokens = np.array([1, 50, 258, 17, 9], np.int32)
    rows = np.arange(tokens.size)
    got, want = (b.forward([SeqInput(b.new_seq(), tokens, 0, rows)])[0].logits for b in (gated, plain))
    assert np.array_equal(got, want)
    gated.close()
    plain.close()


def test_the_load_says_its_setup_is_done_before_packing_and_stops_when_the_head_cannot_wait() -> None:
    """`on_setup_done` runs once, before `before_head`; a `before_head` that raises ends the load with its
    error (the caller's tokenizer failed: nothing more to pack)."""
    path = str(tiny_model_path("llama", weight_type="Q4_K"))
    calls: list[str] = []

    def refuse() -> None:
        calls.append("head")
        raise RuntimeError("tokenizer failed")

    opts = BackendOptions(n_ctx=512, n_seq_max=1, threads=1, on_setup_done=lambda: calls.append("setup"), before_head=refuse)
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        NativeBackend(path, opts)
    assert calls == ["setup", "head"]
