"""Lossless harness on real GGUF models through the exact CPU backends (torch fp32, native).

Tiny deterministic fixtures (llama, qwen2, qwen3; for the native backend also with every matrix in
each block type it reads) run property-based; SmolLM2 runs a few fixed prompts under
@pytest.mark.slow on both backends. Reference: one token per forward over a separate backend instance.
"""

from __future__ import annotations

from functools import cache

import anyio
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from toy_backend import GarbageDrafter, OracleDrafter, RepeatDrafter, make_engine, plain_decode, run_requests

from spekula.core.backend import BackendOptions, load_backend
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

N_CTX = 96
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 5, "spec-ngram-mod-n-match": 2,
                "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 5}


# None: the fixture's default mix (F32/F16 attention, Q8_0 feed-forward, F16 embedding)
WEIGHT_TYPES = (None, "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "IQ4_NL", "IQ4_XS", "MXFP4", "Q3_K", "Q2_K")


@cache
def _tiny(arch: str, weight_type: str | None = None) -> tuple[str, Tokenizer]:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    path = str(tiny_model_path(arch, weight_type=weight_type))
    return path, Tokenizer.from_gguf(GGUFFile(path))


def _backend(path: str, n_seq: int, name: str = "torch", threads: int = 1):  # type: ignore[no-untyped-def]
    return load_backend(name, path, BackendOptions(n_ctx=N_CTX, n_seq_max=n_seq, threads=threads))


# No shrinking: each example loads a model; a failure report with the raw example is enough.
@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(arch=st.sampled_from(["llama", "qwen2", "qwen3"]),
       prompts=st.lists(st.lists(st.integers(3, 300), min_size=1, max_size=6), min_size=1, max_size=3),
       repeats=st.integers(1, 3), n_predict=st.integers(1, 24),
       types=st.lists(st.sampled_from(["ngram-simple", "ngram-mod", "suffix", "test-repeat", "test-garbage"]),
                      min_size=1, max_size=3, unique=True),
       temperature=st.sampled_from([0.0, 0.8]), n_slots=st.integers(1, 2), seed=st.integers(0, 2**31),
       runtime=st.sampled_from([("torch", None), *[("native", t) for t in WEIGHT_TYPES]]),
       threads=st.integers(1, 2), adaptive=st.booleans())
def test_tiny_models_lossless(arch, prompts, repeats, n_predict, types, temperature, n_slots, seed, runtime,  # type: ignore[no-untyped-def]
                              threads, adaptive) -> None:
    name, weight_type = runtime
    path, tok = _tiny(arch, weight_type)
    backend = _backend(path, n_slots, name, threads)
    spec = SpecParams(types=tuple(types), drafter_options=dict(SMALL_NGRAMS), adaptive=adaptive)
    engine = make_engine(backend, tok, n_slots=n_slots, n_ctx=N_CTX, n_batch=64, spec=spec,
                         drafters=[RepeatDrafter(), GarbageDrafter(backend.info.n_vocab, n_max=3)])
    sampling = SamplingParams(temperature=temperature, seed=seed)
    reqs = [CompletionRequest(p * repeats, n_predict=n_predict, sampling=sampling, ignore_eos=True) for p in prompts]
    finals = anyio.run(run_requests, engine, reqs, 120.0)
    ref_backend = _backend(path, 1, name, 1)
    for req, final in zip(reqs, finals, strict=True):
        assert final.error is None
        ref = plain_decode(ref_backend, req.prompt, n_predict=n_predict, sampling=sampling, seed=seed,
                           is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True)
        assert final.tokens == ref
        assert final.timings.get("draft_n", 0) >= final.timings.get("draft_n_accepted", 0) >= 0


@cache
def _hybrid(model: str) -> tuple[str, Tokenizer]:
    from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

    arch, _, outtype = model.partition("-")
    path = str(tiny_qwen35_gguf_path(moe=arch == "qwen35moe", outtype=outtype or "f32"))
    return path, Tokenizer.from_gguf(GGUFFile(path))


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(model=st.sampled_from(["qwen35", "qwen35moe", "qwen35-q8_0", "qwen35moe-q8_0"]),
       runtime=st.sampled_from(["torch", "native"]),
       prompts=st.lists(st.lists(st.integers(3, 300), min_size=1, max_size=6), min_size=1, max_size=2),
       repeats=st.integers(1, 3), n_predict=st.integers(1, 24),
       types=st.lists(st.sampled_from(["ngram-simple", "ngram-mod", "suffix", "test-repeat", "test-garbage"]),
                      max_size=2, unique=True),
       temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 2**31), n_max=st.integers(1, 8),
       threads=st.integers(1, 2), adaptive=st.booleans())
def test_hybrid_models_lossless(model, runtime, prompts, repeats, n_predict, types, temperature, seed, n_max,  # type: ignore[no-untyped-def]
                                threads, adaptive) -> None:
    """Qwen3.5 fixtures: every draft length is accepted now and then (the oracle drafter knows plain
    decoding's tokens and spoils one in half its drafts), so the recurrent state rolls back by every amount."""
    if runtime == "torch" and model.endswith("-q8_0"):
        model = model.removesuffix("-q8_0")  # torch dequantizes: the float file covers it
    path, tok = _hybrid(model)
    sampling = SamplingParams(temperature=temperature, seed=seed)
    reqs = [CompletionRequest(p * repeats, n_predict=n_predict, sampling=sampling, ignore_eos=True) for p in prompts]
    ref_backend = _backend(path, 1, runtime, 1)
    refs = [plain_decode(ref_backend, req.prompt, n_predict=n_predict, sampling=sampling, seed=seed,
                         is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True) for req in reqs]
    backend = _backend(path, len(reqs), runtime, threads)
    spec = SpecParams(types=(*types, "test-oracle"), n_max=n_max, drafter_options=dict(SMALL_NGRAMS), adaptive=adaptive)
    oracle = OracleDrafter([[*req.prompt, *ref] for req, ref in zip(reqs, refs, strict=True)], backend.info.n_vocab,
                           n_max=n_max, seed=seed)
    engine = make_engine(backend, tok, n_slots=len(reqs), n_ctx=N_CTX, n_batch=64, spec=spec,
                         drafters=[RepeatDrafter(), GarbageDrafter(backend.info.n_vocab, n_max=3), oracle])
    finals = anyio.run(run_requests, engine, reqs, 120.0)
    for final, ref in zip(finals, refs, strict=True):
        assert final.error is None
        assert final.tokens == ref


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["torch", "native"])
def test_smollm2_greedy_lossless_with_ngram_drafters(backend_name: str) -> None:
    from spekula.backends.gguf.default_model import ensure_default_model

    try:
        path = str(ensure_default_model())
    except Exception as exc:  # offline machine without the cached model
        pytest.skip(f"default model unavailable: {exc}")
    tok = Tokenizer.from_gguf(GGUFFile(path))
    text = tok.apply_chat_template([{"role": "user", "content": "Count: one two three one two three one two"}])
    prompt = tok.encode(text)
    n_ctx, n_predict = 256, 24
    backend = load_backend(backend_name, path, BackendOptions(n_ctx=n_ctx, n_seq_max=2))  # engine slot + reference
    spec = SpecParams(types=("ngram-simple", "ngram-mod"),
                      drafter_options={"spec-ngram-simple-size-n": 3, "spec-ngram-mod-n-match": 3,
                                       "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 8})
    engine = make_engine(backend, tok, n_ctx=n_ctx, n_batch=256, spec=spec)
    greedy = SamplingParams(temperature=0.0)
    [final] = anyio.run(run_requests, engine, [CompletionRequest(prompt, n_predict=n_predict, sampling=greedy)], 600.0)
    ref = plain_decode(backend, prompt, n_predict=n_predict, sampling=greedy, seed=0, is_eog=tok.is_eog, n_ctx=n_ctx)
    assert final.tokens == ref
    assert final.content == tok.decode(ref, skip_special=True)
