"""Slot save / restore / erase in the engine (core/engine/slot_actions.py).

A restored slot must go on exactly as the saved one: the same tokens, the same reused prefix and the same
drafts, whatever its drafters keep per slot (description.slot_state). Busy slots, unknown actions and ids,
backends without state export and failed writes are refused and change nothing.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from slot_helpers import GREEDY, complete, repeating_prompt, serving, slot_engine
from toy_backend import ToyBackend, ToyTokenizer, make_engine

from spekula.core.engine.engine import Engine
from spekula.core.engine.slot_actions import SlotActionError
from spekula.core.errors import ConfigError
from spekula.core.events import FinalEvent
from spekula.core.params import CompletionRequest

DRAFT_FIELDS = ("draft_n", "draft_n_accepted", "cache_n", "prompt_n")


# draftless drafters keeping nothing per slot, a model drafter rebuilding its state from the history, both
# together, and the drafters whose per-slot tables and counters the file carries (description.slot_state)
DRAFTERS = ["ngram-simple", "draft-simple", "ngram-simple,draft-simple", "ngram-map-k", "ngram-map-k4v",
            "ngram-cache", "ngram-mod", "suffix"]


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_restored_slot_continues_as_the_uninterrupted_one(arch: str, backend: str, drafter: str,
                                                          tmp_path: Path) -> None:
    """Uninterrupted: turn 1 on slot 0, another request on slot 2, turn 2 on slot 0. Interrupted: turn 1 on
    slot 0, saved, slot 0 erased, the other request on slot 2, the file restored into slot 1, turn 2 there.
    The server-wide pools see the same requests in the same order, so everything a slot carries must come
    through the file for turn 2 to draft and answer alike."""
    prompt, other = repeating_prompt(1), repeating_prompt(2)

    async def uninterrupted() -> tuple[FinalEvent, FinalEvent, dict[str, Any]]:
        async with serving(slot_engine(arch, backend, drafter)) as engine:
            first = await complete(engine, prompt, 0)
            await complete(engine, other, 2)
            second = await complete(engine, [*prompt, *first.tokens, *prompt[:9]], 0, 48)
            return first, second, _drafter_states(engine, 0)

    async def interrupted() -> tuple[FinalEvent, FinalEvent, dict[str, Any], dict[str, Any]]:
        async with serving(slot_engine(arch, backend, drafter)) as engine:
            first = await complete(engine, prompt, 0)
            saved = await engine.slot_action("save", 0, tmp_path / "s.bin")
            await engine.slot_action("erase", 0)
            await complete(engine, other, 2)
            restored = await engine.slot_action("restore", 1, tmp_path / "s.bin")
            assert restored["n_restored"] == saved["n_saved"] == len(prompt) + len(first.tokens) - 1
            assert restored["n_read"] == saved["n_written"] == (tmp_path / "s.bin").stat().st_size
            second = await complete(engine, [*prompt, *first.tokens, *prompt[:9]], 1, 48)
            return first, second, saved, _drafter_states(engine, 1)

    first_u, second_u, states_u = anyio.run(uninterrupted)
    first_i, second_i, saved, states_i = anyio.run(interrupted)
    assert first_i.tokens == first_u.tokens
    assert second_i.tokens == second_u.tokens
    assert second_i.timings["cache_n"] == second_u.timings["cache_n"] == saved["n_saved"]
    assert {k: second_i.timings.get(k) for k in DRAFT_FIELDS} == {k: second_u.timings.get(k) for k in DRAFT_FIELDS}
    # after turn 2 the drafters' per-slot tables and counters are the same too
    assert states_i.keys() == states_u.keys()
    for name, arrays in states_u.items():
        assert (arrays is None) == (states_i[name] is None)
        for key, value in (arrays or {}).items():
            np.testing.assert_array_equal(states_i[name][key], value, err_msg=f"{name} {key}")


def _drafter_states(engine: Engine, slot: int) -> dict[str, Any]:
    return {name: d.save_slot(slot) for name, d in engine._drafters.items() if hasattr(d, "save_slot")}


def test_erase_and_restore_reach_the_drafters_saved_state(tmp_path: Path) -> None:
    """The saved drafters' per-slot state goes into the file, comes back into another slot, and an erase
    forgets it (so without the file the restored turn would draft differently: the test above can fail)."""
    prompt = repeating_prompt(6)

    async def go() -> None:
        async with serving(slot_engine("llama", "native", "ngram-map-k4v")) as engine:
            await complete(engine, prompt, 0)
            drafter = engine._drafters["ngram-map-k4v"]
            state = drafter.save_slot(0)
            assert state is not None and len(state["key_tokens"]) > 0
            await engine.slot_action("save", 0, tmp_path / "m.bin")
            await engine.slot_action("erase", 0)
            assert drafter.save_slot(0) is None
            await engine.slot_action("restore", 2, tmp_path / "m.bin")
            again = drafter.save_slot(2)
            assert again is not None and again.keys() == state.keys()
            for name in state:
                np.testing.assert_array_equal(again[name], state[name])

    anyio.run(go)


def test_each_drafter_says_what_slot_files_carry_of_it() -> None:
    from spekula.core.drafting.registry import drafter_entries

    entries = [e for e in drafter_entries() if e.builtin]
    assert {e.name for e in entries if e.description.slot_state == "saved"} == {
        "ngram-map-k", "ngram-map-k4v", "ngram-cache", "ngram-mod"}
    for e in entries:
        cls = e.source
        saved = e.description.slot_state == "saved"
        assert hasattr(cls, "save_slot") == saved and hasattr(cls, "load_slot") == saved, e.name


def test_drafter_states_that_do_not_fit_are_refused_before_anything_changes() -> None:
    from spekula.drafters.draftless.ngram_map import NgramMapK4vDrafter

    hist = np.array(repeating_prompt(7, 30), np.int32)
    mine, other = NgramMapK4vDrafter(1, 4), NgramMapK4vDrafter(2, 4)
    for d in (mine, other):
        d.begin(0, hist[:20])
        d.draft_one(0, hist, 5)
    state, before = mine.save_slot(0), other.save_slot(0)
    assert state is not None and before is not None
    with pytest.raises(ConfigError, match="size-n 1"):
        other.load_slot(0, state)
    with pytest.raises(ConfigError, match="no 'values'"):
        mine.load_slot(1, {k: v for k, v in state.items() if k != "values"})
    with pytest.raises(ConfigError, match="'seen'"):
        mine.load_slot(1, {**state, "seen": state["seen"].astype(np.int64)})
    after = other.save_slot(0)
    assert after is not None and all(np.array_equal(after[k], before[k]) for k in before)
    assert mine.save_slot(1) is None
    mine.load_slot(1, state)
    again = mine.save_slot(1)
    assert again is not None and all(np.array_equal(again[k], state[k]) for k in state)



def test_a_backend_without_state_export_refuses_save_and_restore_by_name(tmp_path: Path) -> None:
    async def go() -> None:
        async with serving(make_engine(ToyBackend(), ToyTokenizer())) as engine:
            for action in ("save", "restore"):
                with pytest.raises(SlotActionError, match="ToyBackend backend cannot save or restore") as info:
                    await engine.slot_action(action, 0, tmp_path / "t.bin")
                assert info.value.kind == "unsupported"
            assert (await engine.slot_action("erase", 0))["n_erased"] == 0  # erasing needs no export
            assert list(tmp_path.iterdir()) == []

    anyio.run(go)



def test_unknown_actions_and_ids_are_refused(tmp_path: Path) -> None:
    async def go() -> None:
        async with serving(slot_engine("llama", "native", "ngram-simple")) as engine:
            with pytest.raises(SlotActionError, match="Invalid action"):
                await engine.slot_action("load", 0, tmp_path / "x")
            with pytest.raises(SlotActionError, match="Invalid slot ID"):
                await engine.slot_action("erase", 3)
            with pytest.raises(SlotActionError, match="needs a file name"):
                await engine.slot_action("save", 0)
            assert list(tmp_path.iterdir()) == []

    anyio.run(go)


def test_an_action_on_a_busy_slot_waits_for_its_request_and_holds_the_slot(tmp_path: Path) -> None:
    """As llama-server defers it: a save asked for while slot 0 generates runs once that request ends, on
    the cache it left, before a request queued for the slot after it; an action whose caller gives up
    while it waits never runs."""
    prompt = repeating_prompt(5)

    async def go() -> None:
        async with serving(slot_engine("llama", "native", "ngram-simple", n_slots=1)) as engine:
            first = engine.submit(CompletionRequest(list(prompt), n_predict=200, sampling=GREEDY, id_slot=0,
                                                    ignore_eos=True))
            while engine.slots()[0]["state"] == "idle":  # until the request runs: slot 0 is busy
                await anyio.sleep(0.005)
            with anyio.CancelScope() as scope:  # a client gone while its erase waits: it must never run
                scope.cancel()
                await engine.slot_action("erase", 0)
            saved: dict[str, Any] = {}
            busy_when_asked: list[bool] = []

            async def save() -> None:
                busy_when_asked.append(engine.slots()[0]["state"] != "idle")
                saved.update(await engine.slot_action("save", 0, tmp_path / "busy.bin"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(save)
                await anyio.sleep(0)
                second = engine.submit(CompletionRequest([*prompt, 7], n_predict=4, sampling=GREEDY, id_slot=0))
                done = await first.result()
                assert done.error is None and len(done.tokens) == 200
                final = await second.result()
            assert busy_when_asked == [True]
            # What the first request left, neither erased nor the second's: the save ran between them.
            assert saved["n_saved"] == len(prompt) + len(done.tokens) - 1
            assert final.error is None and final.timings["cache_n"] == len(prompt)

    anyio.run(go)


def test_a_failed_write_leaves_no_file_and_a_working_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = repeating_prompt(4)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    async def go() -> None:
        async with serving(slot_engine("llama", "native", "ngram-simple")) as engine:
            first = await complete(engine, prompt, 0)
            with monkeypatch.context() as mp:
                mp.setattr(os, "fsync", full)
                with pytest.raises(SlotActionError, match="No space left on device") as info:
                    await engine.slot_action("save", 0, tmp_path / "full.bin")
            assert info.value.kind == "io"
            assert list(tmp_path.iterdir()) == []
            again = await complete(engine, [*prompt, *first.tokens, 5], 0)
            assert again.timings["cache_n"] == len(prompt) + len(first.tokens) - 1
            await engine.slot_action("save", 0, tmp_path / "ok.bin")
            assert [p.name for p in tmp_path.iterdir()] == ["ok.bin"]

    anyio.run(go)


def test_erase_makes_the_next_request_evaluate_its_whole_prompt() -> None:
    prompt = repeating_prompt(5)

    async def go() -> None:
        async with serving(slot_engine("qwen35", "native", "ngram-simple")) as engine:
            first = await complete(engine, prompt, 0)
            erased = await engine.slot_action("erase", 0)
            assert erased == {"id_slot": 0, "n_erased": len(prompt) + len(first.tokens) - 1}
            again = await complete(engine, prompt, 0)
            assert again.timings["cache_n"] == 0 and again.timings["prompt_n"] == len(prompt)
            assert again.tokens == first.tokens

    anyio.run(go)
