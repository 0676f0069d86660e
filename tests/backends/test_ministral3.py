"""mistral3 (Ministral 3) on the native and torch backends (and onnx): YaRN rope and the queries' temperature.

The tiny checkpoint (fixtures/tiny_ministral3.py) has an original context of 16, so every sequence here
crosses it: transformers' own fp32 forward and greedy decoding are the reference for the float file
llama.cpp's converter made of it; the Q8_0 file is checked for the native backend's exactness rules in
the conformance suite (tests/backends/test_backend_conformance.py). Speculation through the engine is
lossless (n-gram, suffix and draft-simple drafters, greedy and sampled), and malformed files are one
ModelFileError naming what is wrong.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from backend_helpers import fresh_logits
from backend_helpers import random_tokens as tokens
from hf_greedy import hf_greedy
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from toy_backend import GarbageDrafter, RepeatDrafter, make_engine, plain_decode, run_requests

from spekula.backends.gguf.architecture import read_hparams
from spekula.backends.gguf.recipes import FEATURES
from spekula.backends.gguf.weights import dequantize
from spekula.core.backend import Backend, BackendOptions, SeqInput, load_backend
from spekula.core.drafting.drafter import DrafterContext
from spekula.core.errors import ModelFileError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.fixtures.tiny_gguf import write_gguf
from spekula.fixtures.tiny_ministral3 import tiny_ministral3_gguf_path, tiny_ministral3_hf_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# torch: fp32 throughout (as tests/backends/test_vs_transformers.py); native: float16 KV cache and its
# own summation order (measured <= 2e-3 on logits of magnitude ~4).
LOGIT_TOL = {"torch": 1e-3, "onnx": 1e-3, "native": 5e-3}
N_CTX = 128
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 5, "spec-ngram-mod-n-match": 2,
                "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 5}


def model_path(type_name: str = "f32") -> Path:
    return tiny_ministral3_gguf_path(type_name=type_name)


@cache
def backend(name: str, type_name: str = "f32", n_seq: int = 2) -> Backend:
    return load_backend(name, str(model_path(type_name)), BackendOptions(n_ctx=N_CTX, n_seq_max=n_seq, threads=1))


@cache
def hf_model() -> Any:
    transformers.logging.set_verbosity_error()
    return transformers.Ministral3ForCausalLM.from_pretrained(str(tiny_ministral3_hf_path()),
                                                              dtype=torch.float32).eval()


def edited(tmp_path: Path, meta: dict[str, Any], drop: tuple[str, ...] = ()) -> Path:
    """The float file with `meta` set (a None value removes the key) and the `drop` keys removed."""
    f = GGUFFile(model_path())
    keys = {k: v for k, v in f.metadata.items() if k != "general.architecture" and k not in drop}
    keys |= {k: v for k, v in meta.items() if v is not None}
    tensors = {e.name: dequantize(e) for e in f.tensors()}
    return write_gguf(tmp_path / "edited.gguf", "mistral3", {}, tensors, keys)


# ---- what the file says ---------------------------------------------------------------------------


def test_file_reads_as_yarn_with_its_temperature() -> None:
    hp = read_hparams(GGUFFile(model_path()), implements=FEATURES)
    yarn, temp = hp.scaling.yarn, hp.attn_temperature
    assert hp.arch == "mistral3" and not hp.rope_neox and yarn is not None and temp is not None
    assert (yarn.freq_scale, yarn.n_ctx_orig, yarn.beta_fast, yarn.beta_slow) == (0.25, 16, 1.0, 0.25)
    # mscale 1 over mscale_all_dim 0.5, as transformers' attention_factor
    assert hp.rope_mscale == pytest.approx(hf_model().model.rotary_emb.attention_scaling)
    assert (temp.scale, temp.floor_len) == (0.5, 16)
    assert temp.factors(np.array([0, 15, 16, 40])).tolist() == pytest.approx(
        [1.0, 1.0, 1 + 0.5 * np.log(2), 1 + 0.5 * np.log(3)])


# ---- against transformers ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["torch", "native", "onnx"])
def test_logits_match_transformers_past_the_original_context(name: str) -> None:
    if name == "onnx":
        pytest.importorskip("onnxruntime")
    ids = tokens(100, seed=1)
    with torch.no_grad():
        want = hf_model()(torch.tensor([ids.tolist()])).logits[0].numpy()
    got = fresh_logits(backend(name), ids)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < LOGIT_TOL[name]


@pytest.mark.parametrize("name", ["torch", "native"])
def test_greedy_decoding_matches_transformers(name: str) -> None:
    b, model = backend(name), hf_model()
    prompt = tokens(12, seed=2)
    want = hf_greedy(model, prompt.tolist(), 40)  # transformers' own incremental decoding
    s = b.new_seq()
    try:
        got = [int(b.forward([SeqInput(s, prompt, 0)])[0].logits[0].argmax())]
        while len(got) < len(want):
            got.append(int(b.forward([SeqInput(s, np.array(got[-1:], np.int32), b.seq_len(s))])[0].logits[0].argmax()))
    finally:
        b.free_seq(s)
    assert got == want


@pytest.mark.parametrize("name", ["torch", "native"])
def test_each_scaling_changes_what_it_should(name: str, tmp_path: Path) -> None:
    """Without the temperature key the rows before the original context are bitwise the same and the later
    ones differ; without the log multiplier the magnitude changes, and with it every row."""
    ids = tokens(40, seed=3)
    want = fresh_logits(backend(name), ids)
    opts = BackendOptions(n_ctx=N_CTX, n_seq_max=1, threads=1)
    cold = fresh_logits(load_backend(name, str(edited(tmp_path, {}, drop=("mistral3.attention.temperature_scale",))),
                                     opts), ids)
    assert np.array_equal(cold[:16], want[:16])
    assert np.abs(cold[16:] - want[16:]).max(axis=1).min() > 10 * LOGIT_TOL[name]
    plain = fresh_logits(load_backend(name, str(edited(tmp_path, {"mistral3.rope.scaling.yarn_log_multiplier": 0.0})),
                                      opts), ids)
    assert np.abs(plain[1:] - want[1:]).max(axis=1).min() > 10 * LOGIT_TOL[name]


# ---- speculation ---------------------------------------------------------------------------------


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(runtime=st.sampled_from([("torch", "f32"), ("native", "f32"), ("native", "q8_0")]),
       prompts=st.lists(st.lists(st.integers(3, 300), min_size=1, max_size=6), min_size=1, max_size=2),
       repeats=st.integers(1, 4), n_predict=st.integers(1, 30),
       types=st.lists(st.sampled_from(["ngram-simple", "ngram-mod", "suffix", "test-repeat", "test-garbage"]),
                      min_size=1, max_size=3, unique=True),
       temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 2**31), adaptive=st.booleans())
def test_speculation_is_lossless(runtime, prompts, repeats, n_predict, types, temperature, seed,  # type: ignore[no-untyped-def]
                                 adaptive) -> None:
    name, type_name = runtime
    path = str(model_path(type_name))
    tok = Tokenizer.from_gguf(GGUFFile(path))
    sampling = SamplingParams(temperature=temperature, seed=seed)
    reqs = [CompletionRequest(p * repeats, n_predict=n_predict, sampling=sampling, ignore_eos=True) for p in prompts]
    ref_backend = backend(name, type_name, 1)
    refs = [plain_decode(ref_backend, req.prompt, n_predict=n_predict, sampling=sampling, seed=seed,
                         is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True) for req in reqs]
    b = load_backend(name, path, BackendOptions(n_ctx=N_CTX, n_seq_max=len(reqs), threads=1))  # the engine's own
    spec = SpecParams(types=tuple(types), drafter_options=dict(SMALL_NGRAMS), adaptive=adaptive)
    engine = make_engine(b, tok, n_slots=len(reqs), n_ctx=N_CTX, n_batch=64, spec=spec,
                         drafters=[RepeatDrafter(), GarbageDrafter(b.info.n_vocab, n_max=3)])
    finals = anyio.run(run_requests, engine, reqs, 120.0)
    for final, ref in zip(finals, refs, strict=True):
        assert final.error is None
        assert final.tokens == ref


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)],
                         ids=["greedy", "sampled"])
def test_draft_simple_with_the_q8_0_file_is_lossless(sampling: SamplingParams) -> None:
    from spekula.drafters.model.draft_simple import DraftSimpleDrafter

    target = load_backend("native", str(model_path()), BackendOptions(n_ctx=N_CTX, n_seq_max=3, threads=1))
    tok = Tokenizer.from_gguf(GGUFFile(str(model_path())))
    spec = SpecParams(types=("draft-simple",), n_max=4, adaptive=False)  # a draft as costly as the target is skipped
    ctx = DrafterContext(spec=spec, target=target, tokenizer=tok, n_seq_max=2, backend_name="native",
                         draft_model_path=str(model_path("q8_0")),
                         draft_backend_options=BackendOptions(n_ctx=N_CTX, n_seq_max=2, threads=1))
    drafter = DraftSimpleDrafter.create(ctx)
    engine = make_engine(target, tok, n_slots=2, n_ctx=N_CTX, spec=spec, drafters=[drafter])
    prompts = [tokens(7, seed=8).tolist() * 2, tokens(20, seed=9).tolist()]
    reqs = [CompletionRequest(prompt=p, n_predict=40, sampling=sampling, ignore_eos=True) for p in prompts]
    finals = anyio.run(run_requests, engine, reqs, 300.0)
    for prompt, final in zip(prompts, finals, strict=True):
        assert final.error is None, final.error
        assert final.tokens == plain_decode(target, prompt, n_predict=40, sampling=sampling,
                                            seed=max(sampling.seed, 0), is_eog=tok.is_eog, n_ctx=N_CTX,
                                            ignore_eos=True)
    stats = engine.stats()["drafters"][drafter.name]
    assert stats["acc_tokens"] > 0  # the Q8_0 copy agrees with its float original most of the time


# ---- malformed files -----------------------------------------------------------------------------


@pytest.mark.parametrize(("meta", "error"), [
    ({"mistral3.rope.scaling.yarn_beta_fast": 0.0}, "invalid YaRN parameters: original context 16, beta_fast 0.0"),
    ({"mistral3.rope.scaling.type": "longrope"}, "unsupported rope scaling 'longrope'"),
    ({"mistral3.rope.scaling.factor": -2.0}, "invalid rope.scaling.factor -2.0"),
])
def test_malformed_scaling_is_one_clear_error(tmp_path: Path, meta: dict[str, Any], error: str) -> None:
    with pytest.raises(ModelFileError, match=error.replace("(", "\\(").replace(".", "\\.")):
        load_backend("native", str(edited(tmp_path, meta)), BackendOptions(n_ctx=32, n_seq_max=1))


def test_moe_mistral3_is_refused_naming_the_missing_dense_ffn(tmp_path: Path) -> None:
    f = GGUFFile(model_path())
    tensors = {e.name: dequantize(e) for e in f.tensors() if "ffn_gate.weight" not in e.name}
    keys = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    path = write_gguf(tmp_path / "moe.gguf", "mistral3", {}, tensors, keys)
    with pytest.raises(ModelFileError, match="missing tensor 'blk.0.ffn_gate.weight' \\(architecture mistral3\\)"):
        load_backend("torch", str(path), BackendOptions(n_ctx=32, n_seq_max=1))


def test_fixed_shape_path_keeps_chunks_and_batches_exact() -> None:
    """CUDA's exact mode (every GEMM on a full tile, padded rows at position 0), run on the CPU: chunked,
    batched and rolled-back rows past the original context are bitwise the plain ones."""
    from unittest import mock

    from spekula.backends.torch.backend import TorchBackend

    with mock.patch("spekula.backends.torch.backend.FIXED_SHAPE_DEVICES", {"cpu", "cuda"}):
        b = TorchBackend(str(model_path()), BackendOptions(n_ctx=N_CTX, n_seq_max=2, threads=1))
    ids = tokens(50, seed=10)
    want = fresh_logits(b, ids)
    a, c = b.new_seq(), b.new_seq()
    try:
        b.forward([SeqInput(a, ids[:20], 0, np.array([], np.int64))])
        b.forward([SeqInput(a, ids[20:27], 20, np.array([], np.int64))])
        b.truncate(a, 23)
        outs = b.forward([SeqInput(a, ids[23:50], 23, np.arange(27)), SeqInput(c, ids, 0, np.arange(50))])
        assert np.array_equal(outs[0].logits, want[23:50]) and np.array_equal(outs[1].logits, want)
    finally:
        b.free_seq(a)
        b.free_seq(c)
