"""Slot save / restore / erase (core/engine/slot_actions.py, slot_file.py, Backend.export_seq / import_seq).

A restored slot must go on exactly as the saved one: the same tokens, the same reused prefix and, with a
drafter whose per-slot state is rebuilt from the history (ngram-simple, draft-simple), the same drafts.
Refused files (corrupt, truncated, foreign, another version or backend) and busy slots change nothing.
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cache
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from backend_helpers import open_backend, random_tokens
from toy_backend import ToyBackend, ToyTokenizer, make_engine

from spekula.core.backend import Backend, BackendOptions, SeqInput, SeqState, load_backend
from spekula.core.engine.engine import Engine
from spekula.core.engine.slot_actions import SlotActionError
from spekula.core.engine.slot_file import FORMAT_VERSION, SlotFileError, slot_path
from spekula.core.errors import ConfigError
from spekula.core.events import FinalEvent
from spekula.core.modelfile.gguf_file import GGUFFile
from spekula.core.modelfile.tokenizer import Tokenizer
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.drafters.model.draft_simple import DraftSimpleDrafter

GREEDY = SamplingParams(temperature=0.0)
N_CTX = 256
SMALL_NGRAMS = {"spec-ngram-simple-size-n": 1, "spec-ngram-simple-size-m": 4,
                "spec-ngram-map-k-size-n": 1, "spec-ngram-map-k-size-m": 4,
                "spec-ngram-map-k4v-size-n": 1, "spec-ngram-map-k4v-size-m": 4,
                "spec-ngram-mod-n-match": 1, "spec-ngram-mod-n-min": 1, "spec-ngram-mod-n-max": 4}


@cache
def _model(arch: str) -> tuple[str, Tokenizer]:
    if arch == "qwen35":
        from spekula.fixtures.tiny_qwen35 import tiny_qwen35_gguf_path

        path = str(tiny_qwen35_gguf_path())
    else:
        from spekula.fixtures.tiny_gguf import tiny_model_path

        path = str(tiny_model_path(arch))
    return path, Tokenizer.from_gguf(GGUFFile(path))


def _engine(arch: str, backend: str, drafter: str, n_slots: int = 3) -> Engine:
    path, tok = _model(arch)
    target = load_backend(backend, path, BackendOptions(n_ctx=N_CTX, n_seq_max=n_slots, threads=1))
    types = tuple(drafter.split(","))
    spec = SpecParams(types=types, n_max=4, adaptive=False, drafter_options=dict(SMALL_NGRAMS))
    drafters: list[Any] | None = None
    if "draft-simple" in types:  # the target's own file drafts: a model drafter that agrees often
        draft = load_backend(backend, path, BackendOptions(n_ctx=N_CTX, n_seq_max=n_slots, threads=1))
        drafters = [DraftSimpleDrafter(draft, target_n_vocab=target.info.n_vocab)]
    return make_engine(target, tok, n_slots=n_slots, n_ctx=N_CTX, n_batch=32, spec=spec, drafters=drafters)


async def _complete(engine: Engine, prompt: list[int], slot: int, n_predict: int = 12) -> FinalEvent:
    handle = engine.submit(CompletionRequest(list(prompt), n_predict=n_predict, sampling=GREEDY, id_slot=slot))
    final = await handle.result()
    assert final.error is None, final.error
    return final


def _prompt(seed: int, n: int = 24) -> list[int]:
    # a repeating segment, so ngram-simple finds drafts
    seg = random_tokens(6, seed, 3, 300).tolist()
    return (seg * (n // 6 + 1))[:n]


@asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[Engine]:
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        yield engine
        tg.cancel_scope.cancel()


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
    prompt, other = _prompt(1), _prompt(2)

    async def uninterrupted() -> tuple[FinalEvent, FinalEvent, dict[str, Any]]:
        async with serving(_engine(arch, backend, drafter)) as engine:
            first = await _complete(engine, prompt, 0)
            await _complete(engine, other, 2)
            second = await _complete(engine, [*prompt, *first.tokens, *prompt[:9]], 0, 48)
            return first, second, _drafter_states(engine, 0)

    async def interrupted() -> tuple[FinalEvent, FinalEvent, dict[str, Any], dict[str, Any]]:
        async with serving(_engine(arch, backend, drafter)) as engine:
            first = await _complete(engine, prompt, 0)
            saved = await engine.slot_action("save", 0, tmp_path / "s.bin")
            await engine.slot_action("erase", 0)
            await _complete(engine, other, 2)
            restored = await engine.slot_action("restore", 1, tmp_path / "s.bin")
            assert restored["n_restored"] == saved["n_saved"] == len(prompt) + len(first.tokens) - 1
            assert restored["n_read"] == saved["n_written"] == (tmp_path / "s.bin").stat().st_size
            second = await _complete(engine, [*prompt, *first.tokens, *prompt[:9]], 1, 48)
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
    prompt = _prompt(6)

    async def go() -> None:
        async with serving(_engine("llama", "native", "ngram-map-k4v")) as engine:
            await _complete(engine, prompt, 0)
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

    hist = np.array(_prompt(7, 30), np.int32)
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


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_exported_state_gives_bitwise_the_same_next_logits(arch: str, backend: str) -> None:
    path, _ = _model(arch)
    a, b = open_backend(backend, path, n_ctx=N_CTX, n_seq=2, threads=1), open_backend(backend, path, n_ctx=N_CTX,
                                                                                       n_seq=2, threads=1)
    ids = random_tokens(40, 5, 3, 300)
    sa, sb = a.new_seq(), b.new_seq()
    a.forward([SeqInput(sa, ids[:37], 0)])
    b.import_seq(sb, a.export_seq(sa))
    assert b.seq_len(sb) == 37
    want = a.forward([SeqInput(sa, ids[37:], 37, np.arange(3))])[0].logits
    got = b.forward([SeqInput(sb, ids[37:], 37, np.arange(3))])[0].logits
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_torch_half_precision_kv_round_trips_as_its_bits(dtype: str) -> None:
    path, _ = _model("llama")
    opts = BackendOptions(n_ctx=N_CTX, n_seq_max=1, threads=1, dtype=dtype)
    a, b = load_backend("torch", path, opts), load_backend("torch", path, opts)
    ids = random_tokens(30, 2, 3, 300)
    sa, sb = a.new_seq(), b.new_seq()
    a.forward([SeqInput(sa, ids[:27], 0)])
    state = a.export_seq(sa)
    assert state.arrays["k"].dtype == np.uint16 and dtype.replace("f16", "float16") in a.seq_state_format
    b.import_seq(sb, state)
    want = a.forward([SeqInput(sa, ids[27:], 27, np.arange(3))])[0].logits
    np.testing.assert_array_equal(b.forward([SeqInput(sb, ids[27:], 27, np.arange(3))])[0].logits, want)


def _sliding_model(name: str) -> Path:
    if name == "gemma4":  # blocks reading other blocks' KV, and heads of two sizes
        from spekula.fixtures.tiny_gemma4 import tiny_gemma4_gguf_path

        return tiny_gemma4_gguf_path()
    if name == "gptoss":
        from spekula.fixtures.tiny_gptoss import tiny_gptoss_gguf_path

        return tiny_gptoss_gguf_path()
    from spekula.fixtures.tiny_gemma3 import tiny_gemma3_gguf_path

    return tiny_gemma3_gguf_path()


@pytest.mark.parametrize("model", ["gemma3", "gemma4", "gptoss"])
def test_native_sliding_rings_round_trip_after_they_wrapped(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from spekula.backends.native import backend as native_backend

    monkeypatch.setattr(native_backend, "SWA_ROW_CAP", 16)  # 256-row rings: 300 positions wrap them
    path = _sliding_model(model)
    a, b = open_backend("native", path, n_ctx=512, n_seq=1, threads=1), open_backend("native", path, n_ctx=512,
                                                                                      n_seq=1, threads=1)
    ids = random_tokens(310, 9, 3, 300)
    sa, sb = a.new_seq(), b.new_seq()
    for i in range(0, 300, 16):
        a.forward([SeqInput(sa, ids[i : min(i + 16, 300)], i)])
    state = a.export_seq(sa)
    b.import_seq(sb, state)
    want = a.forward([SeqInput(sa, ids[300:], 300, np.arange(10))])[0].logits
    got = b.forward([SeqInput(sb, ids[300:], 300, np.arange(10))])[0].logits
    np.testing.assert_array_equal(got, want)
    assert b.restorable(sb, 290) == a.restorable(sa, 290)  # the same window is still in the rings


def test_a_state_that_does_not_fit_changes_nothing() -> None:
    path, _ = _model("llama")
    be = open_backend("native", path, n_ctx=64, n_seq=1, threads=1)
    seq = be.new_seq()
    be.forward([SeqInput(seq, random_tokens(10, 1, 3, 300), 0)])
    state = be.export_seq(seq)
    bad = SeqState(state.length, {"kv": state.arrays["kv"][:-1]})
    with pytest.raises(ConfigError, match="kv"):
        be.import_seq(seq, bad)
    with pytest.raises(ConfigError, match="does not fit"):
        be.import_seq(seq, SeqState(65, state.arrays))
    assert be.seq_len(seq) == 10


def test_onnx_refuses_by_name() -> None:
    class NoState(Backend):  # what a backend without export/import says (the onnx backend inherits it)
        def new_seq(self) -> int: return 0
        def free_seq(self, seq_id: int) -> None: return None
        def seq_len(self, seq_id: int) -> int: return 0
        def truncate(self, seq_id: int, n_keep: int) -> None: return None
        def forward(self, inputs: Any, capture: Any = None) -> list[Any]: return []

    with pytest.raises(ConfigError, match="NoState backend cannot export"):
        NoState().export_seq(0)
    from spekula.backends.onnx.backend import backend_class

    assert backend_class.export_seq is Backend.export_seq and backend_class.import_seq is Backend.import_seq


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


@pytest.mark.parametrize("name", ["", "..", "../x", "a/b", "/etc/passwd", "a\\b", "x\0y", ".hidden", "a..b",
                                  "n" * 256, " pad", "tab\t"])
def test_file_names_that_escape_or_are_not_plain_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(SlotFileError, match="Invalid filename"):
        slot_path(tmp_path, name)
    assert slot_path(tmp_path, "slot-1.bin") == tmp_path / "slot-1.bin"


def _saved(tmp_path: Path) -> tuple[Path, list[int], FinalEvent, dict[str, Any]]:
    """A llama slot file of one finished request (native), and what made it."""
    prompt = _prompt(3)

    async def go() -> tuple[FinalEvent, dict[str, Any]]:
        async with serving(_engine("llama", "native", "ngram-simple")) as engine:
            first = await _complete(engine, prompt, 0)
            return first, await engine.slot_action("save", 0, tmp_path / "good.bin")

    first, saved = anyio.run(go)
    return tmp_path / "good.bin", prompt, first, saved


def _variant(src: Path, name: str, edit: Any) -> Path:
    data = bytearray(src.read_bytes())
    out = src.with_name(name)
    out.write_bytes(bytes(edit(data)))
    return out


def test_bad_files_are_refused_and_the_slot_keeps_its_cache(tmp_path: Path) -> None:
    good, prompt, first, _ = _saved(tmp_path)

    def flip(data: bytearray) -> bytearray:
        data[len(data) // 2] ^= 0x40
        return data

    def version(data: bytearray) -> bytearray:
        data[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "little")
        return data

    cases = {
        _variant(good, "corrupt.bin", flip): "corrupt",
        _variant(good, "truncated.bin", lambda d: d[: len(d) - 100]): "corrupt or truncated",
        _variant(good, "short.bin", lambda d: d[:20]): "too short|truncated",
        _variant(good, "version.bin", version): f"version {FORMAT_VERSION + 1}",
        _variant(good, "magic.bin", lambda d: b"GGUF" + d[4:]): "not a spekula slot file",
        tmp_path / "missing.bin": "no slot file",
    }
    other = [9, 8, 7, 6, 5, 4, 3]

    async def go() -> None:
        async with serving(_engine("llama", "native", "ngram-simple")) as engine:
            mine = await _complete(engine, other, 1)
            for path, why in cases.items():
                with pytest.raises(SlotFileError, match=why):
                    await engine.slot_action("restore", 1, path)
                assert engine.slots()[1]["n_cached"] == len(other) + len(mine.tokens) - 1
            again = await _complete(engine, [*other, *mine.tokens, 4], 1)
            assert again.timings["cache_n"] == len(other) + len(mine.tokens) - 1  # its own cache survived
            restored = await engine.slot_action("restore", 1, good)  # and a good file still restores
            assert restored["n_restored"] == len(prompt) + len(first.tokens) - 1

    anyio.run(go)


def _rewrite_header(src: Path, name: str, edit: Any) -> Path:
    """A copy of `src` whose JSON header `edit` changed, with a valid checksum again (a crafted file)."""
    import hashlib
    import json
    import struct

    data = src.read_bytes()
    magic, version, n = struct.unpack_from("<8sII", data)
    header = edit(json.loads(data[16 : 16 + n]))
    raw = json.dumps(header).encode()
    body = struct.pack("<8sII", magic, version, len(raw)) + raw + data[16 + n : -32]
    out = src.with_name(name)
    out.write_bytes(body + hashlib.sha256(body).digest())
    return out


def test_crafted_headers_with_a_valid_checksum_are_refused(tmp_path: Path) -> None:
    good, *_ = _saved(tmp_path)

    def arrays(edit: Any) -> Any:
        def go(h: dict[str, Any]) -> dict[str, Any]:
            edit(h["arrays"][0])
            return h
        return go

    cases = {
        _rewrite_header(good, "list.bin", lambda h: {**h, "model": [1, 2]}): "bad header",
        _rewrite_header(good, "object.bin", arrays(lambda a: a.update(dtype="|O"))): "bad header",
        _rewrite_header(good, "negative.bin", arrays(lambda a: a.update(shape=[-1, -4]))): "bad header",
        _rewrite_header(good, "huge.bin", arrays(lambda a: a.update(shape=[2**40, 2**40]))): "not the size",
        _rewrite_header(good, "name.bin", arrays(lambda a: a.update(name="elsewhere/kv"))): "array named",
        _rewrite_header(good, "tokens.bin", lambda h: {**h, "n_tokens": h["n_tokens"] + 1}): "tokens at length",
        _rewrite_header(good, "dtype.bin", arrays(lambda a: a.update(dtype="<i2"))): "Unable to restore",
    }

    async def go() -> None:
        async with serving(_engine("llama", "native", "ngram-simple")) as engine:
            for path, why in cases.items():
                with pytest.raises((SlotFileError, SlotActionError), match=why):
                    await engine.slot_action("restore", 0, path)
            await engine.slot_action("restore", 0, good)

    anyio.run(go)


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    good, *_ = _saved(tmp_path)

    async def go(arch: str, backend: str, why: str) -> None:
        async with serving(_engine(arch, backend, "ngram-simple")) as engine:
            with pytest.raises(SlotFileError, match=why):
                await engine.slot_action("restore", 0, good)
            await _complete(engine, [5, 6, 7], 0)  # and it keeps serving

    anyio.run(go, "qwen2", "native", "another model")
    anyio.run(go, "llama", "torch", "another backend")


def test_busy_slots_unknown_actions_and_ids_are_refused(tmp_path: Path) -> None:
    async def go() -> None:
        async with serving(_engine("llama", "native", "ngram-simple")) as engine:
            with pytest.raises(SlotActionError, match="Invalid action"):
                await engine.slot_action("load", 0, tmp_path / "x")
            with pytest.raises(SlotActionError, match="Invalid slot ID"):
                await engine.slot_action("erase", 3)
            with pytest.raises(SlotActionError, match="needs a file name"):
                await engine.slot_action("save", 0)
            handle = engine.submit(CompletionRequest([5, 6, 7, 8], n_predict=200, sampling=GREEDY, id_slot=0,
                                                     ignore_eos=True))
            while engine.slots()[0]["state"] == "idle":  # until the request runs: slot 0 is busy
                await anyio.sleep(0.005)
            for action in ("save", "restore", "erase"):
                with pytest.raises(SlotActionError, match="busy") as info:
                    await engine.slot_action(action, 0, tmp_path / "b.bin")
                assert info.value.kind == "busy"
            assert not (tmp_path / "b.bin").exists()
            final = await handle.result()
            assert final.error is None and len(final.tokens) == 200

    anyio.run(go)


def test_a_failed_write_leaves_no_file_and_a_working_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = _prompt(4)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    async def go() -> None:
        async with serving(_engine("llama", "native", "ngram-simple")) as engine:
            first = await _complete(engine, prompt, 0)
            with monkeypatch.context() as mp:
                mp.setattr(os, "fsync", full)
                with pytest.raises(SlotActionError, match="No space left on device") as info:
                    await engine.slot_action("save", 0, tmp_path / "full.bin")
            assert info.value.kind == "io"
            assert list(tmp_path.iterdir()) == []
            again = await _complete(engine, [*prompt, *first.tokens, 5], 0)
            assert again.timings["cache_n"] == len(prompt) + len(first.tokens) - 1
            await engine.slot_action("save", 0, tmp_path / "ok.bin")
            assert [p.name for p in tmp_path.iterdir()] == ["ok.bin"]

    anyio.run(go)


def test_erase_makes_the_next_request_evaluate_its_whole_prompt() -> None:
    prompt = _prompt(5)

    async def go() -> None:
        async with serving(_engine("qwen35", "native", "ngram-simple")) as engine:
            first = await _complete(engine, prompt, 0)
            erased = await engine.slot_action("erase", 0)
            assert erased == {"id_slot": 0, "n_erased": len(prompt) + len(first.tokens) - 1}
            again = await _complete(engine, prompt, 0)
            assert again.timings["cache_n"] == 0 and again.timings["prompt_n"] == len(prompt)
            assert again.tokens == first.tokens

    anyio.run(go)
