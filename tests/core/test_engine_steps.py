"""Steps made back to back in the worker thread (Engine._steps): the loop still admits, cancels and
delivers in order while one request generates.

The hand-off budget is set out of reach here, so that only the engine's own reasons to hand back
(a request waiting for an idle slot, a slot finished or cancelled) can end a run of steps."""

from __future__ import annotations

import anyio
import pytest
from toy_backend import GatedBackend, ToyBackend, ToyTokenizer, make_engine, plain_decode

import spekula.core.engine.engine as engine_module
from spekula.core.events import FinalEvent, PieceEvent
from spekula.core.params import CompletionRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 9, 4, 17, 5, 8, 2, 11]
LONG = 1800  # tokens: far more steps than a test waits for


@pytest.fixture(autouse=True)
def no_handoff_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "STEPS_PER_HANDOFF_S", 3600.0)


def _plain(n_predict: int, prompt: list[int]) -> list[int]:
    return plain_decode(ToyBackend(n_ctx=2048), prompt, n_predict=n_predict, sampling=GREEDY, seed=0,
                        is_eog=lambda t: False, n_ctx=2048)


@pytest.mark.anyio
async def test_a_request_arriving_mid_generation_takes_the_idle_slot_at_once() -> None:
    # Forwards after the 40th wait for the gate, which opens once the short request is queued: the toy
    # model is fast enough that a stalled loop could otherwise see the long request finish first.
    backend = GatedBackend(40, n_ctx=2048)
    engine = make_engine(backend, ToyTokenizer(), n_slots=2, n_ctx=2048)
    order: list[str] = []
    started = anyio.Event()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            long = engine.submit(CompletionRequest(PROMPT, n_predict=LONG, sampling=GREEDY))

            async def read_long() -> None:
                async for ev in long:
                    started.set()
                    if isinstance(ev, FinalEvent):
                        order.append("long")

            async with anyio.create_task_group() as inner:
                inner.start_soon(read_long)
                await started.wait()
                queued = engine.submit(CompletionRequest([5, 6, 7], n_predict=5, sampling=GREEDY))
                backend.gate.set()
                short = await queued.result()
                # Without the hand-back for a waiting request the short one would have waited for all
                # LONG tokens of the other.
                still = [s for s in engine.slots() if s["request_id"] == long.id]
                assert still and still[0]["n_decoded"] < LONG
            tg.cancel_scope.cancel()
    assert order == ["long"]
    assert short.tokens == _plain(5, [5, 6, 7])
    assert long.final is not None and long.final.tokens == _plain(LONG, PROMPT)


@pytest.mark.anyio
async def test_cancel_ends_a_run_of_steps_and_pieces_come_in_order() -> None:
    backend = GatedBackend(40, n_ctx=2048)
    engine = make_engine(backend, ToyTokenizer(), n_ctx=2048)
    events: list[object] = []
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            handle = engine.submit(CompletionRequest(PROMPT, n_predict=LONG, sampling=GREEDY))
            async for ev in handle:
                events.append(ev)
                if len(events) == 20:
                    handle.cancel()  # while the worker is in a run of steps, held at a forward
                    backend.gate.set()
            tg.cancel_scope.cancel()
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.stop_type == "cancel"
    assert len(final.tokens) < LONG
    pieces = [t for ev in events[:-1] if isinstance(ev, PieceEvent) for t in ev.tokens]
    assert pieces == final.tokens == _plain(LONG, PROMPT)[: len(final.tokens)]
