"""Speculation on gpt-oss is lossless: n-gram and suffix drafters, an oracle whose drafts are accepted by
every amount (so the sliding blocks' KV rings roll back by every amount, across the window's edge), and
draft-simple with the MXFP4 file drafting for the float one; greedy and sampled, on native and torch.
Sequences run past the fixture's 64-token window and its YaRN's original context."""

from __future__ import annotations

from functools import cache

import anyio
import numpy as np
import pytest
from gptoss_helpers import N_CTX, WINDOW, gptoss_path, load_gptoss
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from toy_backend import GarbageDrafter, OracleDrafter, RepeatDrafter, make_engine, plain_decode, run_requests

from spekula.core.backend import Backend, BackendOptions
from spekula.core.drafting.drafter import DrafterContext
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 5, "spec-ngram-mod-n-match": 2,
                "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 5}


@cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(gptoss_path()))


@cache
def reference(name: str, variant: str) -> Backend:
    return load_gptoss(name, variant, n_seq_max=1, threads=1)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(runtime=st.sampled_from([("torch", "f32"), ("native", "f32"), ("native", "mxfp4")]),
       prompts=st.lists(st.lists(st.integers(3, 300), min_size=1, max_size=6), min_size=1, max_size=2),
       repeats=st.integers(1, 4), n_predict=st.integers(1, WINDOW + 24),
       types=st.lists(st.sampled_from(["ngram-simple", "ngram-mod", "suffix", "test-repeat", "test-garbage"]),
                      max_size=2, unique=True),
       temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 2**31), n_max=st.integers(1, 8),
       threads=st.integers(1, 2), adaptive=st.booleans())
def test_speculation_is_lossless(runtime, prompts, repeats, n_predict, types, temperature, seed, n_max,  # type: ignore[no-untyped-def]
                                 threads, adaptive) -> None:
    name, variant = runtime
    tok = tokenizer()
    sampling = SamplingParams(temperature=temperature, seed=seed)
    reqs = [CompletionRequest(p * repeats, n_predict=n_predict, sampling=sampling, ignore_eos=True) for p in prompts]
    refs = [plain_decode(reference(name, variant), req.prompt, n_predict=n_predict, sampling=sampling, seed=seed,
                         is_eog=tok.is_eog, n_ctx=N_CTX, ignore_eos=True) for req in reqs]
    b = load_gptoss(name, variant, n_seq_max=len(reqs), threads=threads)  # the engine's own
    spec = SpecParams(types=(*types, "test-oracle"), n_max=n_max, drafter_options=dict(SMALL_NGRAMS), adaptive=adaptive)
    oracle = OracleDrafter([[*req.prompt, *ref] for req, ref in zip(reqs, refs, strict=True)], b.info.n_vocab,
                           n_max=n_max, seed=seed)
    engine = make_engine(b, tok, n_slots=len(reqs), n_ctx=N_CTX, n_batch=64, spec=spec,
                         drafters=[RepeatDrafter(), GarbageDrafter(b.info.n_vocab, n_max=3), oracle])
    finals = anyio.run(run_requests, engine, reqs, 120.0)
    for final, ref in zip(finals, refs, strict=True):
        assert final.error is None
        assert final.tokens == ref


@pytest.mark.parametrize("name", ["native", "torch"])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)],
                         ids=["greedy", "sampled"])
def test_draft_simple_with_the_mxfp4_file_is_lossless(name: str, sampling: SamplingParams) -> None:
    from spekula.drafters.model.draft_simple import DraftSimpleDrafter

    target, tok = load_gptoss(name, n_seq_max=3, threads=1), tokenizer()
    spec = SpecParams(types=("draft-simple",), n_max=4, adaptive=False)  # a draft as costly as the target is skipped
    ctx = DrafterContext(spec=spec, target=target, tokenizer=tok, n_seq_max=2, backend_name=name,
                         draft_model_path=gptoss_path("mxfp4"),
                         draft_backend_options=BackendOptions(n_ctx=N_CTX, n_seq_max=2, threads=1))
    drafter = DraftSimpleDrafter.create(ctx)
    engine = make_engine(target, tok, n_slots=2, n_ctx=N_CTX, spec=spec, drafters=[drafter])
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 300, 7).tolist() * 2, rng.integers(3, 300, 20).tolist()]
    n_predict = WINDOW + 36  # past the window
    reqs = [CompletionRequest(prompt=p, n_predict=n_predict, sampling=sampling, ignore_eos=True) for p in prompts]
    finals = anyio.run(run_requests, engine, reqs, 300.0)
    for prompt, final in zip(prompts, finals, strict=True):
        assert final.error is None, final.error
        assert final.tokens == plain_decode(target, prompt, n_predict=n_predict, sampling=sampling,
                                            seed=max(sampling.seed, 0), is_eog=tok.is_eog, n_ctx=N_CTX,
                                            ignore_eos=True)
    assert engine.stats()["drafters"][drafter.name]["acc_tokens"] > 0  # the MXFP4 copy often agrees
