"""Probabilities of emitted tokens (n_probs / logprobs): the target's, whatever drafted the tokens."""

from __future__ import annotations

import math
import re

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_backend import GarbageDrafter, RepeatDrafter, ToyBackend, ToyTokenizer, make_engine, run_requests

from spekula.core.backend import SeqInput
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.verify.sampling import Sampler
from spekula.core.verify.token_probs import TokenProbs, post_sampling, pre_sampling


def test_pre_sampling_is_the_log_softmax_with_the_best_first() -> None:
    row = np.array([1.0, 3.0, 3.0, -2.0, -np.inf, 0.5], dtype=np.float32)
    got = pre_sampling(row, 3, 4)
    finite = row[np.isfinite(row)].astype(np.float64)
    logz = math.log(np.exp(finite).sum())
    assert got.token == 3 and got.value == pytest.approx(-2.0 - logz)
    assert [t for t, _ in got.top] == [1, 2, 0, 5]  # ties: the lower id first
    assert got.top[0][1] == pytest.approx(3.0 - logz)
    assert len(pre_sampling(row, 1, 50).top) == 5  # a banned (-inf) token is never an alternative
    assert pre_sampling(row, 4, 0).value == -math.inf and pre_sampling(row, 4, 0).top == ()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.sampled_from([7, 3000, 49152]), n=st.sampled_from([0, 1, 5, 100]),
       ties=st.booleans())
def test_pre_sampling_on_finite_rows_matches_a_float64_log_softmax(seed: int, size: int, n: int, ties: bool) -> None:
    """The usual row (finite float32 scores) takes a shortcut: float32 exponentials summed in float64
    and the n best without sorting the row. Same tokens in the same order as a full sort, values
    within float32 rounding of the float64 log-softmax."""
    r = np.random.default_rng(seed)
    row = (r.standard_normal(size) * 4.0).astype(np.float32)
    if ties:
        row = np.round(row).astype(np.float32)
    token = int(r.integers(size))
    got = pre_sampling(row, token, n)
    x = row.astype(np.float64)
    logp = x - (x.max() + math.log(np.exp(x - x.max()).sum()))
    want = np.argsort(-x, kind="stable")[: min(n, size)]
    assert [t for t, _ in got.top] == want.tolist()
    assert got.value == pytest.approx(logp[token], rel=1e-6, abs=1e-6)
    assert [v for _, v in got.top] == pytest.approx(logp[want].tolist(), rel=1e-6, abs=1e-6)


def test_post_sampling_lists_what_the_chain_kept() -> None:
    row = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=3, top_p=1.0, min_p=0.0), 6, 1)
    got = post_sampling(sampler, row, 1, 10)
    assert [t for t, _ in got.top] == [0, 1, 2]
    assert sum(p for _, p in got.top) == pytest.approx(1.0)
    assert got.value == got.top[1][1] and got.post_sampling
    assert post_sampling(sampler, row, 5, 10).value == 0.0  # removed by top-k
    greedy = Sampler(SamplingParams(temperature=0.0), 6, 1)
    assert post_sampling(greedy, row, 0, 10).top == ((0, 1.0),)


def _reference(req: CompletionRequest, n_ctx: int) -> tuple[list[int], list[TokenProbs]]:
    """Plain decoding with the probabilities of every token, straight over the backend."""
    backend = ToyBackend(n_ctx=n_ctx)
    seq = backend.new_seq()
    sampler = Sampler(req.sampling, backend.info.n_vocab, req.sampling.seed)
    sampler.accept_many(req.prompt)
    out = backend.forward([SeqInput(seq, np.asarray(req.prompt, np.int32), 0)])
    tokens: list[int] = []
    probs: list[TokenProbs] = []
    while True:
        row = out[0].logits[-1]
        view = sampler.clone() if req.post_sampling_probs else None
        t = sampler.sample(row)
        probs.append(pre_sampling(row, t, req.n_probs) if view is None else post_sampling(view, row, t, req.n_probs))
        sampler.accept(t)
        tokens.append(t)
        if len(tokens) >= req.n_predict:
            return tokens, probs
        out = backend.forward([SeqInput(seq, np.array([t], np.int32), len(req.prompt) + len(tokens) - 1)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(temperature=st.sampled_from([0.0, 0.8, 1.5]), seed=st.integers(0, 2**32 - 1), n_probs=st.integers(0, 6),
       post=st.booleans(), types=st.sampled_from([(), ("test-repeat",), ("test-garbage",), ("ngram-simple",)]),
       adaptive=st.booleans(), repeat_penalty=st.sampled_from([1.0, 1.3]))
def test_speculation_reports_the_probabilities_plain_decoding_reports(temperature, seed, n_probs, post, types,  # type: ignore[no-untyped-def]
                                                                     adaptive, repeat_penalty) -> None:
    n_ctx = 128
    spec = SpecParams(types=types, adaptive=adaptive, drafter_options={"spec-ngram-simple-size-n": 2})
    engine = make_engine(ToyBackend(n_ctx=n_ctx), ToyTokenizer(), n_ctx=n_ctx, spec=spec,
                         drafters=[RepeatDrafter(), GarbageDrafter(48)])
    sampling = SamplingParams(temperature=temperature, top_k=20, seed=seed, repeat_penalty=repeat_penalty)
    req = CompletionRequest([3, 9, 4, 17, 5, 8, 2, 11], n_predict=80, sampling=sampling, ignore_eos=True,
                            token_probs=True, n_probs=n_probs, post_sampling_probs=post)
    streamed: list[TokenProbs] = []

    def on_event(ev) -> None:  # type: ignore[no-untyped-def]
        if getattr(ev, "drafters", None) is not None:
            assert ev.probs is not None and len(ev.probs) == len(ev.tokens)
            streamed.extend(ev.probs)

    [final] = anyio.run(run_requests, engine, [req], 30.0, on_event)
    want_tokens, want_probs = _reference(req, n_ctx)
    assert final.tokens == want_tokens
    assert final.probs == want_probs
    assert streamed == want_probs


@pytest.mark.parametrize("post", [False, True])
def test_drafted_tokens_report_the_targets_probabilities(post: bool) -> None:
    spec = SpecParams(types=("test-repeat",), adaptive=False)
    engine = make_engine(ToyBackend(), ToyTokenizer(), spec=spec, drafters=[RepeatDrafter()])
    req = CompletionRequest([3, 9, 4, 17, 5, 8, 2, 11], n_predict=120, sampling=SamplingParams(temperature=0.0, seed=0),
                            ignore_eos=True, token_probs=True, n_probs=4, post_sampling_probs=post)
    [final] = anyio.run(run_requests, engine, [req])
    assert final.timings["draft_n_accepted"] > 10  # many tokens came from drafts
    assert (final.tokens, final.probs) == _reference(req, 256)


def test_no_probabilities_unless_asked() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer())
    req = CompletionRequest([1, 2, 3], n_predict=5, sampling=SamplingParams(temperature=0.0))
    [final] = anyio.run(run_requests, engine, [req])
    assert final.probs is None and len(final.tokens) == 5


def test_socket_completion_carries_llama_server_probabilities() -> None:
    from rpc_peer import connected, run

    from spekula.core.backend import BackendOptions, load_backend
    from spekula.core.modelfile.gguf_file import GGUFFile
    from spekula.core.modelfile.tokenizer import Tokenizer
    from spekula.fixtures.tiny_gguf import tiny_model_path

    path = str(tiny_model_path("llama"))
    tokenizer = Tokenizer.from_gguf(GGUFFile(path))
    backend = load_backend("native", path, BackendOptions(n_ctx=128, n_seq_max=1))

    async def body() -> None:
        engine = make_engine(backend, tokenizer, n_ctx=128)
        async with connected(engine) as peer:
            params = {"prompt": "hello", "n_predict": 6, "temperature": 0, "n_probs": 3, "return_tokens": True}
            whole = (await peer.call("completion", params))["result"]
            probs = whole["completion_probabilities"]
            assert [p["id"] for p in probs] == whole["tokens"]
            assert all(len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"] for p in probs)
            assert all(bytes(p["bytes"]) == tokenizer.token_bytes(p["id"]) for p in probs)
            streamed = await peer.call("completion", {**params, "stream": True}, rid=2)
            assert "completion_probabilities" not in streamed["result"]
            assert [p for n in peer.notes for p in n["params"]["completion_probabilities"]] == probs
            bad = await peer.call("completion", {**params, "n_probs": 1000}, rid=3)
            assert "n_probs" in bad["error"]["message"]
            # A stop word takes its tokens' probabilities with it (llama-server's rule).
            params = {**params, "prompt": "the cat sat on the mat and the dog", "ignore_eos": True}
            long = (await peer.call("completion", {**params, "n_predict": 24}, rid=4))["result"]
            runs = [m.group() for m in re.finditer("[A-Za-z]{2,}", long["content"]) if m.start() >= 4]
            assert runs, long["content"]
            stopped = (await peer.call("completion", {**params, "n_predict": 24, "stop": [runs[0]]}, rid=5))["result"]
            assert stopped["stop_type"] == "word"
            n_word = len(tokenizer.encode(runs[0], add_special=False, parse_special=False))
            kept = max(len(stopped["tokens"]) - n_word, 0)
            assert stopped["completion_probabilities"] == long["completion_probabilities"][:kept]

    try:
        run(body, timeout=30)
    finally:
        backend.close()
