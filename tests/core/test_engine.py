"""Engine behaviour on the toy backend: batching, stops, cancellation, errors, events, statistics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest
from toy_backend import (
    GarbageDrafter,
    GatedBackend,
    ObservingDrafter,
    RepeatDrafter,
    ToyBackend,
    ToyTokenizer,
    make_engine,
    plain_decode,
    run_requests,
)

from spekula.core.errors import ConfigError
from spekula.core.events import FinalEvent, PieceEvent, ProgressEvent
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.stats.stats import DrafterStats

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 9, 4, 17, 5, 8, 2, 11]


def _plain(n_predict: int, prompt: list[int] = PROMPT, sampling: SamplingParams = GREEDY, seed: int = 0,
           n_ctx: int = 256, eog: frozenset[int] = frozenset(), ignore_eos: bool = False) -> list[int]:
    return plain_decode(ToyBackend(), prompt, n_predict=n_predict, sampling=sampling, seed=seed,
                        is_eog=lambda t: t in eog, n_ctx=n_ctx, ignore_eos=ignore_eos)


@pytest.mark.anyio
async def test_plain_engine_matches_reference_loop() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer())
    [final] = await run_requests(engine, [CompletionRequest(PROMPT, n_predict=40, sampling=GREEDY)])
    assert final.tokens == _plain(40)
    assert final.stop_type == "limit"
    assert final.timings["predicted_n"] == 40 and final.timings["prompt_n"] == len(PROMPT)
    assert "draft_n" not in final.timings  # absent when nothing was drafted (docs/semantics.md §4.2)
    assert final.content == ToyTokenizer().decode(final.tokens)


@pytest.mark.anyio
async def test_speculation_is_lossless_and_accepts() -> None:
    drafter = RepeatDrafter()
    spec = SpecParams(types=("test-repeat",))
    engine = make_engine(ToyBackend(), ToyTokenizer(), spec=spec, drafters=[drafter])
    pieces: list[PieceEvent] = []
    [final] = await run_requests(engine, [CompletionRequest(PROMPT, n_predict=80, sampling=GREEDY)],
                                 on_event=lambda e: pieces.append(e) if isinstance(e, PieceEvent) else None)
    assert final.tokens == _plain(80)
    t = final.timings
    assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    assert [tok for p in pieces for tok in p.tokens] == final.tokens
    assert "".join(p.text for p in pieces) == final.content
    proposed = [d for p in pieces for d in p.drafters]
    assert proposed.count("test-repeat") == t["draft_n_accepted"]
    assert all(len(p.drafters) == len(p.tokens) and p.drafters[-1] is None for p in pieces)
    st = engine.stats()["drafters"]["test-repeat"]
    assert st["acc_tokens"] == t["draft_n_accepted"] and st["gen_tokens"] == t["draft_n"]
    assert st["calls_begin"] == 1 and drafter.begun == [0]
    assert all(mine for _, _, mine in drafter.accepts)
    hist = engine.stats()["histogram"]
    assert sum(n * c for n, c in enumerate(hist)) == t["draft_n_accepted"]


@pytest.mark.anyio
async def test_garbage_drafter_changes_nothing_and_stats_lines_parse() -> None:
    spec = SpecParams(types=("test-garbage",))
    engine = make_engine(ToyBackend(), ToyTokenizer(), spec=spec, drafters=[GarbageDrafter(48)])
    [final] = await run_requests(engine, [CompletionRequest(PROMPT, n_predict=30, sampling=GREEDY)])
    assert final.tokens == _plain(30)
    assert final.timings["draft_n"] > 0
    for line in engine.spec_stats.lines():
        name, parsed = DrafterStats.parse_line(line)
        st = engine.stats()["drafters"][name]
        assert parsed.n_gen_tokens == st["gen_tokens"] and parsed.n_acc_tokens == st["acc_tokens"]
        assert parsed.n_call_accept == st["calls_accept"] and parsed.n_gen_drafts == st["gen_drafts"]
        assert parsed.n_acc_tokens <= parsed.n_gen_tokens and parsed.n_acc_drafts <= parsed.n_gen_drafts


@pytest.mark.anyio
async def test_priority_and_fall_through() -> None:
    """The repeat drafter (draftless) goes first; when it has nothing the model-based one drafts."""
    repeat, observer = RepeatDrafter(), ObservingDrafter(48)
    # Fixed lengths: on the toy's microsecond forwards the cost model would rightly stop asking.
    spec = SpecParams(types=("test-observer", "test-repeat"), adaptive=False)
    engine = make_engine(ToyBackend(), ToyTokenizer(), spec=spec, drafters=[observer, repeat])
    pieces: list[PieceEvent] = []
    [final] = await run_requests(engine, [CompletionRequest(PROMPT, n_predict=60, sampling=GREEDY)],
                                 on_event=lambda e: pieces.append(e) if isinstance(e, PieceEvent) else None)
    assert final.tokens == _plain(60)
    st = engine.stats()["drafters"]
    assert st["test-repeat"]["calls_draft"] >= st["test-observer"]["calls_draft"] > 0
    # observe() ran after every forward including the prompt, with the captured layer
    assert observer.observed[0] == (0, 0, len(PROMPT), (1,))
    # accept() reached both drafters, flagged mine only for the one whose draft was verified
    assert any(not mine for _, _, mine in repeat.accepts) and any(mine for _, _, mine in repeat.accepts)


@pytest.mark.anyio
async def test_batching_puts_all_slots_in_one_forward() -> None:
    backend = ToyBackend()
    engine = make_engine(backend, ToyTokenizer(), n_slots=3, n_batch=64)
    reqs = [CompletionRequest([i + 1, 5, 7, 9], n_predict=20, sampling=GREEDY) for i in range(3)]
    finals = await run_requests(engine, reqs)
    for req, final in zip(reqs, finals, strict=True):
        assert final.tokens == _plain(20, prompt=req.prompt)
    # 3 prompts in one forward, then 19 single-token rounds where all three share the forward
    assert backend.n_forward == 20
    assert max(backend.rows_per_forward) == 12


@pytest.mark.anyio
async def test_prompt_chunks_respect_n_batch() -> None:
    backend = ToyBackend()
    engine = make_engine(backend, ToyTokenizer(), n_batch=5)
    prompt = list(range(1, 23))
    [final] = await run_requests(engine, [CompletionRequest(prompt, n_predict=10, sampling=GREEDY)])
    assert final.tokens == _plain(10, prompt=prompt)
    assert max(backend.rows_per_forward) <= 5


@pytest.mark.anyio
async def test_queueing_when_slots_are_busy() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=2, spec=SpecParams(types=("test-repeat",)),
                         drafters=[RepeatDrafter()])
    reqs = [CompletionRequest([i + 2, 4, 6], n_predict=15 + i, sampling=GREEDY) for i in range(5)]
    finals = await run_requests(engine, reqs)
    for req, final in zip(reqs, finals, strict=True):
        assert final.tokens == _plain(req.n_predict, prompt=req.prompt)
    assert engine.health() == {"status": "ok", "slots_idle": 2, "slots_busy": 0, "queued": 0}


@pytest.mark.anyio
async def test_eos_and_ignore_eos() -> None:
    ref = _plain(30)
    eog = frozenset({ref[5]})
    tok = ToyTokenizer(eog_ids=eog)
    engine = make_engine(ToyBackend(), tok, spec=SpecParams(types=("test-repeat",)), drafters=[RepeatDrafter()])
    first, second = await run_requests(engine, [
        CompletionRequest(PROMPT, n_predict=30, sampling=GREEDY),
        CompletionRequest(PROMPT, n_predict=30, sampling=GREEDY, ignore_eos=True)])
    expected = _plain(30, eog=eog)
    assert first.tokens == expected and first.stop_type == "eos" and first.tokens[-1] in eog
    assert not first.content.endswith(tok.token_text(ref[5]))  # EOG renders no text
    assert second.tokens == ref and second.stop_type == "limit"


@pytest.mark.anyio
async def test_stop_string_cuts_content_and_holds_back_partial_matches() -> None:
    tok = ToyTokenizer()
    ref = _plain(40)
    text = tok.decode(ref)
    stop = text[12:15]
    pieces: list[PieceEvent] = []
    engine = make_engine(ToyBackend(), tok, spec=SpecParams(types=("test-repeat",)), drafters=[RepeatDrafter()])
    [final] = await run_requests(engine, [CompletionRequest(PROMPT, n_predict=40, sampling=GREEDY, stop=[stop])],
                                 on_event=lambda e: pieces.append(e) if isinstance(e, PieceEvent) else None)
    cut = text.find(stop)
    assert final.stop_type == "word" and final.stopping_word == stop
    assert final.content == text[:cut]
    assert final.tokens == ref[: cut + len(stop)]  # one character per toy token
    assert "".join(p.text for p in pieces) == final.content
    assert stop not in "".join(p.text for p in pieces)


@pytest.mark.anyio
async def test_context_full_and_prompt_too_long() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_ctx=24, n_slots=1,
                         spec=SpecParams(types=("test-repeat",)), drafters=[RepeatDrafter()])
    too_long, ok = await run_requests(engine, [
        CompletionRequest(list(range(1, 25)), n_predict=5, sampling=GREEDY),
        CompletionRequest(PROMPT, n_predict=-1, sampling=GREEDY)])
    assert too_long.stop_type == "error" and "context" in (too_long.error or "")
    assert ok.stop_type == "limit" and len(PROMPT) + len(ok.tokens) == 24
    assert ok.tokens == _plain(-1, n_ctx=24)


@pytest.mark.anyio
async def test_cancel_frees_slot_and_leaves_others_alone() -> None:
    # Forwards past the 10th after start-up wait until the victim is cancelled: the toy model is fast
    # enough for the victim's 400 tokens to be done before the loop reads its third event on a loaded machine.
    backend = GatedBackend(10**9, n_ctx=512)
    engine = make_engine(backend, ToyTokenizer(), n_slots=2, n_ctx=512, spec=SpecParams(types=("test-repeat",)),
                         drafters=[RepeatDrafter()])
    backend.open_for = backend.calls + 10  # the engine timed its forwards when it was made
    victim = CompletionRequest(PROMPT, n_predict=400, sampling=GREEDY, id="victim")
    other = CompletionRequest([5, 6, 7], n_predict=60, sampling=GREEDY, id="other")
    finals: dict[str, FinalEvent] = {}
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            h_victim, h_other = engine.submit(victim), engine.submit(other)

            async def watch_victim() -> None:
                n = 0
                async for _ev in h_victim:
                    n += 1
                    if n == 3:
                        h_victim.cancel()
                        backend.gate.set()
                        assert not engine.cancel("no-such-request")
                assert h_victim.final is not None
                finals["victim"] = h_victim.final
                # the slot is free again: a new request gets served while `other` still runs
                finals["next"] = await engine.submit(CompletionRequest([1, 2], n_predict=5, sampling=GREEDY)).result()

            async with anyio.create_task_group() as inner:
                inner.start_soon(watch_victim)
                finals["other"] = await h_other.result()
            tg.cancel_scope.cancel()
    assert finals["victim"].stop_type == "cancel" and len(finals["victim"].tokens) < 400
    assert finals["other"].tokens == _plain(60, prompt=[5, 6, 7])
    assert finals["next"].tokens == _plain(5, prompt=[1, 2])


@pytest.mark.anyio
async def test_seeded_sampling_is_identical_with_speculation() -> None:
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=1234)
    engine = make_engine(ToyBackend(), ToyTokenizer(), spec=SpecParams(types=("test-repeat",)), drafters=[RepeatDrafter()])
    [final] = await run_requests(engine, [CompletionRequest(PROMPT, n_predict=50, sampling=sampling)])
    assert final.tokens == _plain(50, sampling=sampling, seed=1234)


@pytest.mark.anyio
async def test_bad_requests_get_clear_errors() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer())
    empty, bad_ids, bad_type, fine = await run_requests(engine, [
        CompletionRequest([], n_predict=3), CompletionRequest([1, 999], n_predict=3),
        CompletionRequest([1, 2], n_predict=3, spec=SpecParams(types=("no-such-drafter",))),
        CompletionRequest([1, 2], n_predict=3, sampling=GREEDY)])
    assert empty.stop_type == bad_ids.stop_type == bad_type.stop_type == "error"
    assert "no-such-drafter" in (bad_type.error or "") and "available" in (bad_type.error or "")
    assert fine.tokens == _plain(3, prompt=[1, 2])


def test_unknown_server_wide_type_fails_at_start() -> None:
    with pytest.raises(ConfigError, match="available"):
        make_engine(ToyBackend(), ToyTokenizer(), spec=SpecParams(types=("nope",)))


@pytest.mark.anyio
async def test_slots_and_props_report_state() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=2)
    assert [s["state"] for s in engine.slots()] == ["idle", "idle"]
    props = engine.props()
    assert props["n_slots"] == 2 and props["model"]["n_vocab"] == 48
    [final] = await run_requests(engine, [CompletionRequest(PROMPT, n_predict=4, sampling=GREEDY)])
    assert engine.stats()["n_requests"] == 1 and engine.stats()["n_tokens_predicted"] == 4
    assert isinstance(np.asarray(final.tokens), np.ndarray)


class _ExplodingDrafter(GarbageDrafter):
    name = "test-exploding"

    def draft(self, requests):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")


@pytest.mark.anyio
async def test_failing_drafter_ends_only_its_request() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=2, drafters=[_ExplodingDrafter(48)])
    bad, good = await run_requests(engine, [
        CompletionRequest(PROMPT, n_predict=20, sampling=GREEDY, spec=SpecParams(types=("test-exploding",))),
        CompletionRequest([5, 6, 7], n_predict=20, sampling=GREEDY)])
    assert bad.stop_type == "error" and "boom" in (bad.error or "") and "test-exploding" in (bad.error or "")
    assert good.tokens == _plain(20, prompt=[5, 6, 7])


class _BadConfidenceDrafter(GarbageDrafter):
    name = "test-bad-confidence"
    model_based = True

    def __init__(self, n_vocab: int, confidence: object) -> None:
        super().__init__(n_vocab)
        self.confidence = confidence

    def draft(self, requests):  # type: ignore[no-untyped-def]
        drafts = super().draft(requests)
        for d in drafts:
            d.confidence = self.confidence
        return drafts


@pytest.mark.anyio
@pytest.mark.parametrize(("confidence", "message"), [([0.5], "confidences for a draft of"),
                                                     (["sure"] * 4, "could not convert")])
async def test_a_drafter_with_malformed_confidence_ends_only_its_request(confidence: object, message: str) -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=2, drafters=[_BadConfidenceDrafter(48, confidence)])
    bad, good = await run_requests(engine, [
        CompletionRequest(PROMPT, n_predict=20, sampling=GREEDY, spec=SpecParams(types=("test-bad-confidence",))),
        CompletionRequest([5, 6, 7], n_predict=20, sampling=GREEDY)])
    assert bad.stop_type == "error" and message in (bad.error or "") and "test-bad-confidence" in (bad.error or "")
    assert good.tokens == _plain(20, prompt=[5, 6, 7])


class _ProbsDrafter(GarbageDrafter):
    """Proposes tokens with a uniform draft distribution q, like a probabilistic model drafter."""

    name = "test-probs"
    model_based = True

    def draft(self, requests):  # type: ignore[no-untyped-def]
        drafts = super().draft(requests)
        for d in drafts:
            d.probs = np.full((len(d.tokens), self.n_vocab), 1.0 / self.n_vocab, dtype=np.float32)
        return drafts


@pytest.mark.anyio
async def test_verifier_choice_follows_draft_sampling_mode() -> None:
    sampling = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=99)
    greedy_mode = SpecParams(types=("test-probs",), adaptive=False)  # every round verifies a draft
    prob_mode = greedy_mode.with_(draft_sampling="probabilistic")
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=3, drafters=[_ProbsDrafter(48)])
    match_seeded, rejection, match_greedy = await run_requests(engine, [
        CompletionRequest(PROMPT, n_predict=60, sampling=sampling, spec=greedy_mode),
        CompletionRequest(PROMPT, n_predict=60, sampling=sampling, spec=prob_mode),
        CompletionRequest(PROMPT, n_predict=60, sampling=GREEDY, spec=prob_mode)])
    # sample-and-match (greedy draft mode, or temperature 0) reproduces plain decoding exactly
    assert match_seeded.tokens == _plain(60, sampling=sampling, seed=99)
    assert match_greedy.tokens == _plain(60)
    # rejection sampling accepts a uniform-q draft token with probability min(1, p*V): often, at temp 0.8
    t = rejection.timings
    assert len(rejection.tokens) == 60 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    assert t["draft_n_accepted"] > match_seeded.timings["draft_n_accepted"]


@pytest.mark.anyio
async def test_slow_reader_gets_every_event_without_stalling_others() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=2)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            slow = engine.submit(CompletionRequest(PROMPT, n_predict=200, sampling=GREEDY))
            fast = await engine.submit(CompletionRequest([5, 6, 7], n_predict=150, sampling=GREEDY)).result()
            while engine.health()["slots_busy"]:  # the slow request finishes although nobody reads it
                await anyio.sleep(0.01)
            events = [ev async for ev in slow]
            tg.cancel_scope.cancel()
    assert fast.tokens == _plain(150, prompt=[5, 6, 7])
    assert len(events) > 64 and isinstance(events[-1], FinalEvent)
    pieces = [t for ev in events[:-1] for t in ev.tokens]  # type: ignore[union-attr]
    assert pieces == events[-1].tokens == _plain(200)


@pytest.mark.anyio
async def test_prompt_progress_events_come_before_the_first_piece() -> None:
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=2, n_batch=5)
    prompt = [*PROMPT, *PROMPT, 7]  # 17 tokens: chunks of at most 5 (the two requests share each forward)
    events: list[object] = []
    asked = CompletionRequest(prompt, n_predict=4, sampling=GREEDY, return_progress=True, timings_per_token=True)
    finals = await run_requests(engine, [asked, CompletionRequest(prompt, n_predict=4, sampling=GREEDY)],
                                on_event=events.append)
    progress = [e for e in events if isinstance(e, ProgressEvent)]
    assert progress and all(e.request_id == asked.id and e.total == 17 and e.cache == 0 for e in progress)
    done = [e.processed for e in progress]
    assert done[0] == 0 and done[-1] == 17 and done == sorted(set(done))
    assert all(b - a <= 5 for a, b in zip(done, done[1:], strict=False))
    mine = [e for e in events if getattr(e, "request_id", None) == asked.id]
    assert isinstance(mine[len(progress)], PieceEvent)  # every progress event precedes the first token
    assert all(isinstance(e, ProgressEvent) for e in mine[:len(progress)])
    assert all(e.timings is not None for e in mine if isinstance(e, PieceEvent))
    assert finals[0].tokens == finals[1].tokens == _plain(4, prompt)


@pytest.mark.anyio
async def test_a_caller_wanting_only_the_result_gets_only_the_final_event() -> None:
    """result() says the pieces are not wanted: the engine stops sending them (and the final event still
    carries the whole answer), while a request iterated beside it gets every piece."""
    engine = make_engine(ToyBackend(), ToyTokenizer(), n_slots=2)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            streamed = engine.submit(CompletionRequest(PROMPT, n_predict=120, sampling=GREEDY,
                                                       spec=SpecParams(types=("ngram-simple",))))
            quiet = engine.submit(CompletionRequest(PROMPT, n_predict=120, sampling=GREEDY, return_progress=True))
            received: list[object] = []
            events_of = quiet._events

            async def counted() -> AsyncIterator[object]:
                async for ev in events_of():
                    received.append(ev)
                    yield ev

            quiet._events = counted  # type: ignore[method-assign,assignment]
            final = await quiet.result()
            events = [ev async for ev in streamed]
            tg.cancel_scope.cancel()
    assert final.tokens == _plain(120) and final.content
    pieces = [t for ev in events if isinstance(ev, PieceEvent) for t in ev.tokens]
    assert pieces == events[-1].tokens == _plain(120)  # type: ignore[union-attr]
    assert received == [final]  # no piece and no progress event reached the quiet request's stream
