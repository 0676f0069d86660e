"""Context shift in the engine (core/engine/context_shift.py, EngineConfig.context_shift).

* llama-server's arithmetic for n_keep and n_discard;
* plain decoding past n_ctx on a one-block tiny llama picks, at every step, the token a reference picks
  that re-runs the model from scratch on the shifted token sequence (the tokens llama-server keeps, at
  the positions it gives them): with one block the cached keys and values are functions of token and
  position only (torch: exactly its argmax; native: within float16 rounding of it);
* speculative decoding (draftless drafters, draft-simple, and draft-eagle3 and draft-dflash with their
  heads on the target's backend, over n_keep, n_discard and draft lengths) gives exactly the tokens
  plain decoding gives with the same shifts, on the native backend (bitwise: its shift is deterministic
  and its rows batch-invariant) and on torch;
* what cannot shift is refused: a backend without `shift` at start-up, a model drafter whose caches
  cannot follow (draft-mtp's Gemma 4 assistant mode) at start-up or per request. (draft-mtp's own heads,
  DFlash and DSpark over shifts: tests/drafters/test_*_context_shift.py.)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from toy_backend import ToyBackend, ToyTokenizer, run_requests

from spekula.core.backend import Backend, BackendOptions, Capture, SeqInput, SeqOutput, load_backend
from spekula.core.drafting.drafter import Draft, DraftRequest
from spekula.core.engine.context_shift import shift_span
from spekula.core.engine.engine import Engine, EngineConfig
from spekula.core.engine.request_plan import unshiftable_drafters
from spekula.core.errors import ConfigError
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams

pytest.importorskip("torch")

GREEDY = SamplingParams(temperature=0.0)
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 2, "spec-ngram-simple-size-m": 4}


@pytest.mark.parametrize(("args", "want"), [
    # (n_tokens, n_prompt, n_ctx, n_keep, n_discard, add_bos) -> (n_keep, n_discard)
    ((255, 8, 256, 0, 0, False), (0, 127)),  # half of what follows n_keep, rounded down
    ((255, 8, 256, 0, 0, True), (1, 127)),  # the BOS is kept on top of n_keep
    ((255, 226, 256, -1, 0, True), (227, 14)),  # -1: the whole prompt
    ((255, 250, 256, -1, 0, False), (250, 2)),  # capped at n_ctx - 4
    ((255, 8, 256, 10, 100, False), (10, 100)),  # n_discard as asked
    ((255, 8, 256, 10, 400, False), (10, 244)),  # clamped to n_left - 1
    ((31, 8, 32, 500, 0, False), (28, 1)),
])
def test_shift_span_is_llama_servers_arithmetic(args: tuple[Any, ...], want: tuple[int, int]) -> None:
    assert shift_span(*args) == want


@cache
def _model(n_layer: int, weight_type: str | None = None) -> tuple[str, Tokenizer]:
    from spekula.fixtures.tiny_gguf import tiny_model_path

    path = str(tiny_model_path("llama", n_layer=n_layer, weight_type=weight_type))
    return path, Tokenizer.from_gguf(GGUFFile(path))


def _engine(backend: Backend, tok: Any, n_ctx: int, spec: SpecParams | None = None, **kw: Any) -> Engine:
    config = EngineConfig(n_slots=1, n_ctx=n_ctx, n_batch=64, spec=spec or SpecParams(), context_shift=True)
    return Engine(backend, tok, config, **kw)


def _check_against_recomputation(backend: Backend, prompt: list[int], tokens: list[int], n_ctx: int, n_keep: int,
                                 n_discard: int, add_bos: bool, margin: float) -> int:
    """Walk the engine's greedy tokens; at every step run the model from scratch over the history shifted
    as llama-server shifts it, and check the engine's token is the argmax there (or within `margin` of it:
    the native cache rounds keys to float16 once more after a shift). Returns how many shifts happened."""
    history, shifts = list(prompt), 0
    seq = backend.new_seq()
    for i, token in enumerate(tokens):
        if i:
            if len(history) + 1 >= n_ctx:
                keep, discard = shift_span(len(history), len(prompt), n_ctx, n_keep, n_discard, add_bos)
                history = history[:keep] + history[keep + discard:]
                shifts += 1
            history.append(tokens[i - 1])
        backend.truncate(seq, 0)
        [o] = backend.forward([SeqInput(seq, np.asarray(history, np.int32), 0)])
        row = o.logits[-1]
        assert row.max() - row[token] <= margin, (i, int(np.argmax(row)), token, float(row.max() - row[token]))
    backend.free_seq(seq)
    return shifts


@pytest.mark.parametrize(("backend_name", "margin"), [("torch", 0.0), ("native", 0.1)])
@pytest.mark.parametrize(("n_keep", "n_discard"), [(0, 0), (-1, 0), (3, 5), (2, 30)])
def test_plain_decoding_past_the_context_equals_recomputation(backend_name: str, margin: float, n_keep: int,
                                                              n_discard: int) -> None:
    path, tok = _model(1, "F32")  # F32 weights: the native path's int8 activations would hide the shift's error
    n_ctx, n_predict = 40, 100
    prompt = tok.encode("abc abd abe", add_special=True)
    backend = load_backend(backend_name, path, BackendOptions(n_ctx=n_ctx, n_seq_max=2, threads=1))
    engine = _engine(backend, tok, n_ctx)
    req = CompletionRequest(list(prompt), n_predict=n_predict, sampling=GREEDY, ignore_eos=True, n_keep=n_keep,
                            n_discard=n_discard)
    [final] = anyio.run(run_requests, engine, [req])
    assert final.error is None, final.error
    assert len(final.tokens) == n_predict and final.truncated
    assert _check_against_recomputation(backend, list(prompt), final.tokens, n_ctx, n_keep, n_discard, tok.add_bos,
                                        margin) >= 2
    engine.close()


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Random EAGLE-3 and DFlash heads sized for the two-block tiny llama (reading its layer inputs)."""
    from model_drafter_helpers import random_draft_gguf

    path, _ = _model(2)
    root = tmp_path_factory.mktemp("heads")
    return {"draft-eagle3": str(random_draft_gguf(root / "eagle3.gguf", "eagle3", Path(path), weight_type="F32",
                                                  target_layers=[0, 1, 1])),
            "draft-dflash": str(random_draft_gguf(root / "dflash.gguf", "dflash", Path(path), weight_type="F32",
                                                  target_layers=[0, 1]))}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(n_keep=st.integers(-1, 12), n_discard=st.integers(0, 30), n_max=st.integers(1, 6),
       temperature=st.sampled_from([0.0, 0.9]), seed=st.integers(0, 2**31),
       types=st.sampled_from([("ngram-simple",), ("suffix",), ("ngram-map-k",), ("ngram-mod",), ("draft-simple",),
                              ("ngram-simple", "suffix", "draft-simple"), ("draft-eagle3",),
                              ("ngram-simple", "draft-eagle3"), ("draft-dflash",)]),
       backend_name=st.sampled_from(["native", "torch"]), adaptive=st.booleans())
def test_speculation_with_shifts_equals_plain_decoding(heads: dict[str, str], n_keep: int, n_discard: int, n_max: int,
                                                       temperature: float, seed: int, types: tuple[str, ...],
                                                       backend_name: str, adaptive: bool) -> None:
    """`adaptive` lets the cost model rest the drafters (EAGLE-3 and DFlash then miss forwards: their
    caches have gaps when a shift comes)."""
    path, tok = _model(2)
    n_ctx = 36
    prompt = tok.encode("abc abc abc ab", add_special=True)
    sampling = SamplingParams(temperature=temperature, seed=seed)

    def run(spec_types: tuple[str, ...]) -> Any:
        b = load_backend(backend_name, path, BackendOptions(n_ctx=n_ctx, n_seq_max=1, threads=1))
        spec = SpecParams(types=spec_types, n_max=n_max, adaptive=adaptive, drafter_options=dict(SMALL_NGRAMS))
        draft_path = next((heads[t] for t in spec_types if t in heads), path)
        engine = _engine(b, tok, n_ctx, spec, draft_model_path=draft_path, backend_name=backend_name)
        req = CompletionRequest(list(prompt), n_predict=90, sampling=sampling, ignore_eos=True, n_keep=n_keep,
                                n_discard=n_discard)
        [final] = anyio.run(run_requests, engine, [req], 120.0)
        engine.close()
        assert final.error is None, final.error
        return final

    plain, spec = run(()), run(types)
    assert spec.tokens == plain.tokens and plain.truncated and spec.truncated


def test_slots_shift_independently_and_a_shifted_slot_serves_its_cache() -> None:
    """Two slots shifting at different points, with ngram drafts, give what each gives alone; the next
    request reuses a shifted slot's cache only as far as its tokens still name it, and equals a cold run."""
    path, tok = _model(2)
    n_ctx = 40
    prompts = [tok.encode("abc abc abc ab", add_special=True), tok.encode("xyz xy", add_special=True)]
    reqs = [dict(n_predict=70, n_keep=2, n_discard=9), dict(n_predict=55, n_keep=-1, n_discard=0)]
    spec = SpecParams(types=("ngram-simple",), n_max=4, adaptive=False, drafter_options=dict(SMALL_NGRAMS))

    def engine(n_slots: int) -> Engine:
        b = load_backend("native", path, BackendOptions(n_ctx=n_ctx, n_seq_max=n_slots, threads=1))
        config = EngineConfig(n_slots=n_slots, n_ctx=n_ctx, n_batch=16, spec=spec, context_shift=True)
        return Engine(b, tok, config)

    def request(i: int) -> CompletionRequest:
        return CompletionRequest(list(prompts[i]), sampling=GREEDY, ignore_eos=True, **reqs[i])  # type: ignore[arg-type]

    alone = [anyio.run(run_requests, engine(1), [request(i)])[0].tokens for i in range(2)]
    both = engine(2)
    finals = anyio.run(run_requests, both, [request(0), request(1)])
    assert [f.tokens for f in finals] == alone and all(f.truncated for f in finals)
    [again] = anyio.run(run_requests, both, [request(0)])
    assert again.tokens == alone[0] and again.timings["cache_n"] <= 2


def test_a_backend_without_shift_refuses_at_start_up() -> None:
    with pytest.raises(ConfigError, match="--context-shift: context shift is not supported by the ToyBackend"):
        Engine(ToyBackend(), ToyTokenizer(), EngineConfig(n_ctx=64, context_shift=True))
    Engine(ToyBackend(), ToyTokenizer(), EngineConfig(n_ctx=64))  # without it the same backend serves


class _HiddenStateDrafter:
    """A model drafter that declares no way to follow a shift (as draft-mtp's Gemma 4 assistant mode)."""

    name: ClassVar[str] = "draft-mtp"
    model_based: ClassVar[bool] = True

    def capture(self) -> Capture:
        return Capture()

    def begin(self, slot: int, prompt: np.ndarray) -> None:
        return None

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft.empty() for _ in requests]

    def observe(self, slot: int, inp: SeqInput, out: SeqOutput) -> None:
        return None

    def accept(self, slot: int, n_accepted: int, mine: bool) -> None:
        return None

    def end(self, slot: int) -> None:
        return None


class _FollowingDrafter(_HiddenStateDrafter):
    name: ClassVar[str] = "draft-simple"
    follows_context_shift: ClassVar[bool] = True


def test_model_drafters_must_declare_that_they_follow_a_shift() -> None:
    from spekula.drafters.draftless.ngram_simple import NgramSimpleDrafter
    from spekula.drafters.model.draft_simple import DraftSimpleDrafter
    from spekula.drafters.model.eagle3 import Eagle3Drafter

    assert unshiftable_drafters([_HiddenStateDrafter(), _FollowingDrafter()]) == ["draft-mtp"]  # type: ignore[list-item]
    assert DraftSimpleDrafter.follows_context_shift and Eagle3Drafter.follows_context_shift
    assert not NgramSimpleDrafter.model_based  # draftless drafters read the shifted history at each call


def test_unshiftable_model_drafters_are_refused_at_start_up_and_per_request() -> None:
    from spekula.drafters.model import dflash, dspark, eagle3, mtp, mtp_assistant

    path, tok = _model(1)
    assert not getattr(mtp_assistant.AssistantMtpDrafter, "follows_context_shift", False)
    for follows in (eagle3.Eagle3Drafter, dflash.DFlashDrafter, dspark.DSparkDrafter, mtp.MtpDrafter):
        assert follows.follows_context_shift
    backend = load_backend("native", path, BackendOptions(n_ctx=64, n_seq_max=2, threads=1))

    class Fake(_HiddenStateDrafter):
        @classmethod
        def create(cls, ctx: Any) -> Fake:
            return cls()

    with pytest.raises(ConfigError, match="draft-mtp cannot follow a context shift"):
        _engine(backend, tok, 64, SpecParams(types=("draft-mtp",)), drafters=[Fake])
    engine = _engine(backend, tok, 64, drafters=[Fake])
    req = CompletionRequest(tok.encode("abc"), n_predict=4, spec=SpecParams(types=("draft-mtp",)))
    [final] = anyio.run(run_requests, engine, [req])
    assert final.stop_type == "error" and "draft-mtp cannot follow a context shift" in str(final.error)
    assert final.rejected_spec
    engine.close()
    engine = _engine(backend, tok, 64, drafters=[Fake])
    [ok] = anyio.run(run_requests, engine, [CompletionRequest(tok.encode("abc"), n_predict=4, sampling=GREEDY)])
    assert ok.error is None and len(ok.tokens) == 4
