"""Save, restore and erase an idle slot's cache (llama-server's POST /slots/{id}?action=...).

An action on a busy slot waits until its request ends, as llama-server defers it; from the moment it is
asked for until it is done the slot is reserved: no new request and no embedding job takes it, so the
action sees the cache the finished request left. What touches the slot and the backend (checks, copying
the state out or in, erasing) runs in the engine's worker thread between steps, so the backend is used
by one thread at a time and no request is admitted halfway through one; the file's reading, checking and
writing run in another thread beside the steps, so a large cache does not hold up the other slots'
generation. What a slot file holds is the idle slot's `tokens[:n_cached]` and its backend sequence's state at that length (core/engine/slot_file.py); a
restored slot is to the prompt cache exactly what the saved one was: the next request reuses whatever
prefix of its prompt the tokens cover (core/engine/prompt_cache.py).

The drafters' per-slot states (core/drafting/description.py, `slot_state`): a drafter whose state outlives a
request in a way no history rebuilds ("saved": ngram-map-k, ngram-map-k4v, ngram-cache, ngram-mod) hands it
to the file (Drafter.save_slot) and takes it back on restore (load_slot; a drafter with nothing in the file
forgets the slot's state, as a slot that never ran it). The others keep nothing ("none": ngram-simple, the
suffix drafter's per-request tree) or rebuild it from the next request's history ("history": draft-simple,
the hidden-state drafters), so a restored slot drafts as the saved one would have (tests/core/
test_slot_actions.py compares draft counts). Not saved, because they are the server's and not the slot's:
the server-wide pools (ngram-mod's table, the suffix drafter's earlier outputs, ngram-cache's dynamic
cache) and the adaptive policy's acceptance estimates; they change which drafts are tried, never the tokens.
A recurrent model's snapshots and checkpoint are not saved either: a restored sequence can be reused at its
whole length (any prompt that extends it) or not at all.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from spekula.core.backend import Backend
from spekula.core.drafting.drafter import Drafter
from spekula.core.engine.slot import Slot
from spekula.core.engine.slot_file import SlotImage, model_identity, read_slot_file, write_slot_file
from spekula.core.errors import SpekulaError

SLOT_ACTIONS = ("save", "restore", "erase")
log = logging.getLogger("spekula.engine")


class SlotActionError(SpekulaError):
    """A slot action refused; `kind`: invalid (the request's fault), busy, unsupported, io or unavailable (the server's)."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


def _idle(slot: Slot) -> None:
    """The work below runs only once its slot is idle (SlotActionQueue); this guards that promise."""
    if slot.busy:
        raise SlotActionError(f"slot {slot.id} is busy with a request", "busy")


def export_slot(backend: Backend, drafters: Mapping[str, Drafter], slot: Slot) -> SlotImage:
    """Between steps: the idle slot's cached tokens, its sequence's state at their length and the drafters'
    saved slot states."""
    _idle(slot)
    n = slot.n_cached
    if backend.seq_len(slot.seq_id) != n:  # rows past the named tokens (none are trusted after an error)
        if backend.restorable(slot.seq_id, n) != n:
            raise SlotActionError(f"slot {slot.id}'s sequence cannot be brought back to its {n} cached tokens",
                                  "unsupported")
        backend.truncate(slot.seq_id, n)
    states = {}
    for name, drafter in drafters.items():
        save = getattr(drafter, "save_slot", None)
        if save is not None and (arrays := save(slot.id)) is not None:
            states[name] = arrays
    try:
        state = backend.export_seq(slot.seq_id)
    except (SpekulaError, MemoryError) as exc:
        raise SlotActionError(f"Unable to save slot {slot.id}: {exc}", "io") from None
    return SlotImage(slot.tokens[:n].copy(), state, states)


def import_slot(backend: Backend, drafters: Mapping[str, Drafter], slot: Slot, image: SlotImage) -> None:
    """Between steps: make a checked file's tokens and state the idle slot's cache. The backend checks the
    arrays before it writes, so a refusal leaves the slot's own cache as it was."""
    _idle(slot)
    try:
        backend.import_seq(slot.seq_id, image.state)
    except SpekulaError as exc:
        raise SlotActionError(f"Unable to restore slot {slot.id}: {exc}") from None
    except Exception:
        slot.n_cached = 0  # written halfway: its KV no longer matches any tokens
        raise
    n = int(image.tokens.size)
    slot.tokens[:n] = image.tokens
    slot.n_cached = n
    slot.last_used = time.perf_counter()
    for name, drafter in drafters.items():
        load = getattr(drafter, "load_slot", None)
        if load is None:
            continue
        try:
            load(slot.id, image.drafters.get(name))
        except SpekulaError as exc:  # its state only speeds drafting up: start the slot's afresh instead
            log.warning("slot %d: %s cannot take the saved drafter state (%s); it starts afresh", slot.id, name, exc)
            load(slot.id, None)


def erase_slot(backend: Backend, drafters: Mapping[str, Drafter], slot: Slot) -> dict[str, Any]:
    """Between steps: forget the idle slot's cache and the drafters' saved state of it; the next request on
    it evaluates its whole prompt, as on a slot that never ran one."""
    _idle(slot)
    n = slot.n_cached
    backend.truncate(slot.seq_id, 0)
    slot.n_cached = 0
    for drafter in drafters.values():
        load = getattr(drafter, "load_slot", None)
        if load is not None:
            load(slot.id, None)
    return {"id_slot": slot.id, "n_erased": n}


@dataclass(eq=False)
class _Call:
    """One piece of work queued for the loop to run between steps and, once run, its outcome."""

    work: Callable[[], Any]
    slot: Slot  # the work waits in the queue while this slot is busy
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None
    ran: bool = False


class SlotActionQueue:
    """The engine's slot actions. `perform` runs in the caller's task: file I/O in a thread of its own, the
    slot's part queued for the loop, which runs it between steps in its worker thread (`run_pending`)."""

    def __init__(self, wake_loop: Callable[[], None]) -> None:
        self._calls: deque[_Call] = deque()
        self._wake_loop = wake_loop
        self._reserved: Counter[int] = Counter()  # slot id -> actions asked for and not done
        # Its keys, replaced whole on each change: the worker thread reads it while the loop changes it.
        self._reserved_ids: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        """Whether work waits for the loop and can run now (its slot is idle). Read by the worker thread
        too: tuple() copies the deque in one step."""
        return any(not call.slot.busy for call in tuple(self._calls))

    def reserved(self) -> frozenset[int]:
        """The slots an action waits for or runs on: neither requests nor embedding jobs take them."""
        return self._reserved_ids

    async def perform(self, action: str, slot_id: int, path: Path | None, backend: Backend,
                      slots: Sequence[Slot], drafters: Mapping[str, Drafter]) -> dict[str, Any]:
        if action not in SLOT_ACTIONS:
            raise SlotActionError(f"Invalid action {action!r}: one of {', '.join(SLOT_ACTIONS)}")
        if not 0 <= slot_id < len(slots):
            raise SlotActionError(f"Invalid slot ID {slot_id}: this server has slots 0..{len(slots) - 1}")
        if action != "erase" and path is None:
            raise SlotActionError(f"slot {action} needs a file name")
        if action != "erase" and not backend.seq_state_format:
            raise SlotActionError(f"the {type(backend).__name__} backend cannot save or restore slots; the native "
                                  "and torch backends can", "unsupported")
        slot = slots[slot_id]
        self._reserved[slot_id] += 1
        self._reserved_ids = frozenset(self._reserved)
        try:
            if action == "erase":
                return await self._between_steps(partial(erase_slot, backend, drafters, slot), slot)  # type: ignore[no-any-return]
            assert path is not None
            return await self._save_or_restore(action, slot, path, backend, drafters)
        finally:
            self._reserved[slot_id] -= 1
            if not self._reserved[slot_id]:
                del self._reserved[slot_id]
                self._reserved_ids = frozenset(self._reserved)
                self._wake_loop()  # requests may wait for the slot

    async def _save_or_restore(self, action: str, slot: Slot, path: Path, backend: Backend,
                               drafters: Mapping[str, Drafter]) -> dict[str, Any]:
        slot_id = slot.id
        t0 = time.perf_counter()
        try:
            model = await anyio.to_thread.run_sync(model_identity, backend.info)
        except OSError as exc:
            raise SlotActionError(f"cannot read the model file to identify it: {exc.strerror or exc}", "io") from None
        if action == "save":
            image: SlotImage = await self._between_steps(partial(export_slot, backend, drafters, slot), slot)
            write = partial(write_slot_file, path, image, model=model, state_format=backend.seq_state_format,
                            n_ctx=slot.n_ctx)
            try:
                n_bytes = await anyio.to_thread.run_sync(write)
            except OSError as exc:
                raise SlotActionError(f"Unable to save slot {slot_id} to {path.name!r}: {exc.strerror or exc}; "
                                      "nothing was written", "io") from None
            return {"id_slot": slot_id, "filename": path.name, "n_saved": int(image.tokens.size),
                    "n_written": n_bytes, "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}
        read = partial(read_slot_file, path, model=model, state_format=backend.seq_state_format, n_ctx=slot.n_ctx)
        image, n_read = await anyio.to_thread.run_sync(read)
        await self._between_steps(partial(import_slot, backend, drafters, slot, image), slot)
        return {"id_slot": slot_id, "filename": path.name, "n_restored": int(image.tokens.size), "n_read": n_read,
                "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}

    async def _between_steps(self, work: Callable[[], Any], slot: Slot) -> Any:
        call = _Call(work, slot)
        self._calls.append(call)
        self._wake_loop()
        try:
            await call.done.wait()
        except BaseException:  # its caller went away (a client disconnected): it must not run later
            if call in self._calls:
                self._calls.remove(call)
            raise
        if call.error is not None:
            raise call.error
        return call.result

    async def run_pending(self) -> None:
        """On the loop, with no step running: the queued work whose slot is idle, in the worker thread."""
        calls = [call for call in self._calls if not call.slot.busy]
        for call in calls:
            self._calls.remove(call)
        try:
            await anyio.to_thread.run_sync(_run, calls)
        finally:
            for call in calls:
                if not call.ran:
                    call.error = SlotActionError("engine stopped before the slot action ran", "unavailable")
                call.done.set()

    def fail_all(self, message: str) -> None:
        while self._calls:
            call = self._calls.popleft()
            call.error = SlotActionError(message, "unavailable")
            call.done.set()


def _run(calls: list[_Call]) -> None:
    for call in calls:
        try:
            call.result = call.work()
        except Exception as exc:  # noqa: BLE001 - handed to its caller; the engine goes on serving
            call.error = exc
        call.ran = True
