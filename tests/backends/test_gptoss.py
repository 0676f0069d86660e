"""gpt-oss on the native and torch backends: attention sinks, q/k/v/o biases, biased experts routed by a
softmax over the top-k router logits, the clamped SwiGLU, MXFP4 experts.

transformers' own fp32 ``GptOssForCausalLM`` of the tiny checkpoint is the reference for llama.cpp's
conversion of it, on sequences well past the fixture's sliding window (64 tokens; every other block
slides) and its YaRN's original context (64). The native backend keeps keys and values in float16,
so it is held to transformers with its keys and values rounded to float16 (measured 3e-5; 6e-3 from
the unrounded reference). The MXFP4 file (llama-quantize MXFP4_MOE) is checked for exactness here and
in the conformance suite; its values differ from the float file's by the 4-bit rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backend_helpers import fresh_logits
from backend_helpers import random_tokens as tokens
from gptoss_helpers import BACKENDS, N_CTX, WINDOW, gptoss_path, load_gptoss

from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.recipes import FEATURES
from spekula.core.backend import Backend, SeqInput
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.fixtures.tiny_gguf import write_gguf
from spekula.fixtures.tiny_gptoss import N_EXPERT_USED, N_HEAD, tiny_gptoss_hf_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-3  # as tests/backends/test_vs_transformers.py


@cache
def hf_model() -> Any:
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny_gptoss_hf_path()), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@contextmanager
def half_kv() -> Iterator[None]:
    """transformers' attention reading keys and values rounded to float16, as the native cache holds them."""
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    eager = m.eager_attention_forward

    def rounded(module: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        return eager(module, q, k.half().float(), v.half().float(), *args, **kwargs)

    m.eager_attention_forward = rounded
    try:
        yield
    finally:
        m.eager_attention_forward = eager


def hf_logits(ids: np.ndarray, *, f16_kv: bool) -> np.ndarray:
    with torch.no_grad():
        if f16_kv:
            with half_kv():
                return hf_model()(torch.tensor([ids.tolist()])).logits[0].numpy()
        return hf_model()(torch.tensor([ids.tolist()])).logits[0].numpy()


@cache
def backend(name: str, variant: str = "f32") -> Backend:
    return load_gptoss(name, variant, threads=1)


# ---- the description ---------------------------------------------------------------------------------


def test_description() -> None:
    hp = read_hparams(GGUFFile(gptoss_path()), implements=FEATURES)
    assert hp.arch == "gpt-oss" and hp.recipe.attn_sinks and hp.has_qkv_bias and hp.rope_neox
    assert hp.sliding_window == WINDOW and hp.ffn_norm_name == "post_attention_norm"
    assert hp.swa_layers == (True, False, True, False)  # as transformers' layer_types: block 0 slides
    assert hp.scaling.yarn is not None and hp.scaling.yarn.n_ctx_orig == 64  # every block ropes with YaRN
    assert hp.rope_mscale == pytest.approx(1.0 + 0.1 * np.log(4.0))
    assert hp.moe is not None and hp.moe.gating == "softmax_weight" and hp.moe.activation == "swiglu_oai"
    assert hp.moe.expert_bias and not hp.moe.norm_weights and hp.moe.n_expert_used == N_EXPERT_USED


def test_a_runtime_without_its_operations_names_them() -> None:
    with pytest.raises(ModelFileError, match="attention sinks") as err:
        read_hparams(GGUFFile(gptoss_path()), runtime="the onnx backend")
    assert "swiglu_oai" in str(err.value) and "the onnx backend" in str(err.value)


# ---- against transformers ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_logits_match_transformers(name: str) -> None:
    ids = tokens(N_CTX - 40, seed=1)  # positions past three windows
    want = hf_logits(ids, f16_kv=name == "native")
    got = fresh_logits(backend(name), ids)
    assert np.abs(got - want).max() < LOGIT_TOL


def test_the_fixture_exercises_sinks_clamps_and_routing() -> None:
    """Not a no-op path: the sinks move the logits, gates reach the clamp, rows choose different experts."""
    model, ids = hf_model(), torch.tensor([tokens(WINDOW - 4, seed=1).tolist()])
    gate_max, choices = [], set()
    hooks = [layer.mlp.experts.register_forward_hook(lambda _m, inp, _o: gate_max.append(float(
        (inp[0] @ _m.gate_up_proj[0] + _m.gate_up_proj_bias[0])[..., ::2].max()))) for layer in model.model.layers]
    hooks += [layer.mlp.router.register_forward_hook(lambda _m, _i, out: choices.update(
        tuple(sorted(r)) for r in out[2].tolist())) for layer in model.model.layers]
    try:
        with torch.no_grad():
            base = model(ids).logits
            saved = [layer.self_attn.sinks.clone() for layer in model.model.layers]
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
            no_sinks = model(ids).logits
            for layer, s in zip(model.model.layers, saved, strict=True):
                layer.self_attn.sinks.copy_(s)
    finally:
        for h in hooks:
            h.remove()
    assert float((base - no_sinks).abs().max()) > 0.1
    assert max(gate_max) > 7.0  # expert 0's gates alone pass the clamp limit
    assert len(choices) >= 4  # of the 6 possible expert pairs
    assert model.model.layers[0].self_attn.sinks.numel() == N_HEAD


@pytest.mark.parametrize("name", BACKENDS)
def test_greedy_decoding_matches_transformers(name: str) -> None:
    prompt, n_new = tokens(12, seed=2), 2 * WINDOW
    model = hf_model()
    with torch.no_grad():  # transformers' own incremental decoding with its KV cache
        out = model(torch.tensor([prompt.tolist()]), use_cache=True)
        want = [int(out.logits[0, -1].argmax())]
        for _ in range(n_new - 1):
            out = model(torch.tensor([want[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            want.append(int(out.logits[0, -1].argmax()))
    b = backend(name)
    s = b.new_seq()
    try:
        got = [int(b.forward([SeqInput(s, prompt, 0)])[0].logits[0].argmax())]
        while len(got) < n_new:
            got.append(int(b.forward([SeqInput(s, np.array(got[-1:], np.int32), b.seq_len(s))])[0].logits[0].argmax()))
    finally:
        b.free_seq(s)
    assert got == want


# ---- MXFP4 experts -------------------------------------------------------------------------------------


def test_mxfp4_file_keeps_experts_in_mxfp4_blocks() -> None:
    f = GGUFFile(gptoss_path("mxfp4"))
    kinds = {f.tensor(f"blk.{i}.ffn_{k}_exps.weight").type_name for i in range(4) for k in ("gate", "up", "down")}
    assert kinds == {"MXFP4"}
    # torch dequantizes the blocks to float; the native kernels read them with int8 activations, as
    # llama.cpp does: the greedy choices agree on nearly every row.
    ids = tokens(2 * WINDOW, seed=3)
    got, want = (fresh_logits(backend(name, "mxfp4"), ids) for name in ("native", "torch"))
    assert float(np.mean(got.argmax(1) == want.argmax(1))) >= 0.9


@pytest.mark.parametrize("variant", ["f32", "mxfp4"])
def test_native_rows_are_bitwise_independent_of_batch_chunks_and_threads(variant: str) -> None:
    """Each sequence alone on one thread, against all three in one batch on two threads with the two longer
    ones split after their first 3 tokens (the long one runs past the window)."""
    seqs = [tokens(n, seed=20 + n) for n in (5, WINDOW + 40, 1)]
    alone = [fresh_logits(backend("native", variant), t) for t in seqs]
    many = load_gptoss("native", variant, threads=2)
    ids = [many.new_seq() for _ in seqs]
    cut = [3, 3, 0]  # tokens of each sequence in the first forward
    first = many.forward([SeqInput(i, t[:c], 0, np.arange(c)) for i, t, c in zip(ids, seqs, cut, strict=True) if c])
    rest = many.forward([SeqInput(i, t[c:], c, np.arange(t.size - c)) for i, t, c in zip(ids, seqs, cut, strict=True)])
    heads = iter(first)
    for t, c, want, tail in zip(seqs, cut, alone, rest, strict=True):
        got = np.concatenate([next(heads).logits, tail.logits]) if c else tail.logits
        assert np.array_equal(got, want), t.size


@pytest.mark.parametrize("name", BACKENDS)
def test_wrapped_rings_give_full_attention_with_the_window_mask(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """700 tokens, far past the window: native's sliding blocks keep rings of the window plus 16 rows (so
    they wrap ten times; the other tests' rings never wrap), torch keeps every key and masks; both against
    transformers' eager attention (every key, the window mask). Native's rows are also the same bits when
    the sequence comes in chunks and decode steps."""
    from spekula.backends.native import backend as native_backend

    monkeypatch.setattr(native_backend, "SWA_ROW_CAP", 16)
    ids = tokens(700, seed=7)
    b = load_gptoss(name, n_ctx=1024, threads=1)
    got = fresh_logits(b, ids)
    assert np.abs(got - hf_logits(ids, f16_kv=name == "native")).max() < LOGIT_TOL
    if name != "native":
        return
    s = b.new_seq()
    parts = [b.forward([SeqInput(s, ids[:300], 0, np.arange(300))])[0].logits]
    parts += [b.forward([SeqInput(s, ids[i : i + 1], i, np.arange(1))])[0].logits for i in range(300, 310)]
    parts += [b.forward([SeqInput(s, ids[310 + 16 * j : 326 + 16 * j], 310 + 16 * j, np.arange(16))])[0].logits
              for j in range(24)]
    parts += [b.forward([SeqInput(s, ids[694:], 694, np.arange(6))])[0].logits]
    assert np.array_equal(np.concatenate(parts), got)


# ---- malformed files -------------------------------------------------------------------------------------


def _edited(tmp: Path, drop_tensor: str = "", drop_key: str = "", reshape: str = "",
            meta: dict[str, Any] | None = None) -> str:
    f = GGUFFile(gptoss_path())
    tensors = {e.name: np.array(e.data) for e in f.tensors() if e.name != drop_tensor}
    if reshape:
        tensors[reshape] = tensors[reshape][:, :-1].copy()
    keys = {k: v for k, v in f.metadata.items() if k not in ("general.architecture", drop_key)} | (meta or {})
    return str(write_gguf(tmp / "edited.gguf", "gpt-oss", {}, tensors, keys))


@pytest.mark.parametrize(("edit", "needle"), [
    ({"drop_tensor": "blk.1.attn_sinks.weight"}, "missing tensor 'blk.1.attn_sinks.weight'"),
    ({"drop_tensor": "blk.2.ffn_gate_inp.bias"}, "missing tensor 'blk.2.ffn_gate_inp.bias'"),
    ({"reshape": "blk.0.ffn_up_exps.bias"}, r"'blk.0.ffn_up_exps.bias' has shape \(4, 31\), expected \(4, 32\)"),
    ({"drop_key": "gpt-oss.expert_used_count"}, "gpt-oss.expert_used_count"),
    ({"drop_key": "gpt-oss.attention.sliding_window"}, "missing metadata key 'gpt-oss.attention.sliding_window'"),
    ({"meta": {"gpt-oss.attention.sliding_window_pattern": [True, False]}},
     r"sliding_window_pattern must list one flag per block \(4\)"),
])
@pytest.mark.parametrize("name", BACKENDS)
def test_malformed_files_are_clear_errors(tmp_path: Path, name: str, edit: dict[str, Any], needle: str) -> None:
    from spekula.core.backend import BackendOptions, load_backend

    path = _edited(tmp_path, **edit)
    with pytest.raises(ModelFileError, match=needle):
        load_backend(name, path, BackendOptions(n_ctx=N_CTX))


def test_torch_fixed_shape_path_keeps_chunks_and_batches_exact() -> None:
    """CUDA's exact mode (every GEMM, attention group and expert on a full tile, padded rows), run on the
    CPU: chunked, batched and rolled-back rows past the window are bitwise the plain ones."""
    from unittest import mock

    from spekula.backends.torch.backend import TorchBackend
    from spekula.core.backend import BackendOptions

    with mock.patch("spekula.backends.torch.backend.FIXED_SHAPE_DEVICES", {"cpu", "cuda"}):
        b = TorchBackend(gptoss_path(), BackendOptions(n_ctx=N_CTX, n_seq_max=2, threads=1))
    n = WINDOW + 40
    ids = tokens(n, seed=10)
    want = fresh_logits(b, ids)
    a, c = b.new_seq(), b.new_seq()
    none = np.array([], np.int64)
    try:
        b.forward([SeqInput(a, ids[:50], 0, none)])
        b.forward([SeqInput(a, ids[50:WINDOW + 7], 50, none)])
        b.truncate(a, WINDOW + 2)  # a rollback across the window's edge
        outs = b.forward([SeqInput(a, ids[WINDOW + 2:], WINDOW + 2, np.arange(n - WINDOW - 2)),
                          SeqInput(c, ids, 0, np.arange(n))])
        assert np.array_equal(outs[0].logits, want[WINDOW + 2:]) and np.array_equal(outs[1].logits, want)
    finally:
        b.free_seq(a)
        b.free_seq(c)
