"""Save, restore and erase an idle slot's cache (llama-server's POST /slots/{id}?action=...).

The engine runs these in its worker thread between steps (Engine.slot_action), so the backend is used by
one thread at a time and no request is admitted halfway through one. What a slot file holds is the idle
slot's `tokens[:n_cached]` and its backend sequence's state at that length (core/engine/slot_file.py); a
restored slot is to the prompt cache exactly what the saved one was: the next request reuses whatever
prefix of its prompt the tokens cover (core/engine/prompt_cache.py).

What is not saved, and what follows from it:
- the drafters' per-slot states. draft-simple and the hidden-state drafters free their sequences when a
  request ends and rebuild them from the next request's history; the suffix drafter starts a tree per
  request; ngram-simple keeps nothing. So with these drafters a restored slot drafts exactly as the saved
  one would have (tests/core/test_slot_actions.py compares draft counts). The n-gram tables of
  ngram-map-k, ngram-map-k4v and ngram-cache, ngram-mod's low-acceptance count, the server-wide pools
  (ngram-mod's, the suffix drafter's earlier outputs) and the adaptive policy's acceptance estimates stay
  with the slot or the server, as after any request: `begin` trims what the new prompt contradicts. They
  change which drafts are tried, never the tokens (docs/http.md, "Slot files").
- a recurrent model's snapshots and checkpoint: a restored sequence can be reused at its whole length
  (any prompt that extends it) or not at all, where the saved one could also go back to its snapshots.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from spekula.core.backend import Backend
from spekula.core.engine.slot import Slot
from spekula.core.engine.slot_file import SlotImage, model_identity, read_slot_file, write_slot_file
from spekula.core.errors import SpekulaError

SLOT_ACTIONS = ("save", "restore", "erase")


class SlotActionError(SpekulaError):
    """A slot action refused; `kind`: invalid (the request's fault), busy, unsupported, io or unavailable (the server's)."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


def _idle(slot: Slot) -> None:
    if slot.busy:
        raise SlotActionError(f"slot {slot.id} is busy with a request; try again when it is idle", "busy")


def save_slot(backend: Backend, slot: Slot, path: Path) -> dict[str, Any]:
    """Write the idle slot's cached tokens and KV state to `path` (atomically)."""
    _idle(slot)
    t0 = time.perf_counter()
    n = slot.n_cached
    if backend.seq_len(slot.seq_id) != n:  # rows past the named tokens (none are trusted after an error)
        if backend.restorable(slot.seq_id, n) != n:
            raise SlotActionError(f"slot {slot.id}'s sequence cannot be brought back to its {n} cached tokens",
                                  "unsupported")
        backend.truncate(slot.seq_id, n)
    state = backend.export_seq(slot.seq_id)
    image = SlotImage(slot.tokens[:n].copy(), state)
    try:
        n_bytes = write_slot_file(path, image, model=model_identity(backend.info),
                                  state_format=backend.seq_state_format, n_ctx=slot.n_ctx)
    except OSError as exc:
        raise SlotActionError(f"Unable to save slot {slot.id} to {path.name!r}: {exc.strerror or exc}; "
                              "nothing was written", "io") from None
    return {"id_slot": slot.id, "filename": path.name, "n_saved": n, "n_written": n_bytes,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


def restore_slot(backend: Backend, slot: Slot, path: Path) -> dict[str, Any]:
    """Make the file's tokens and state the idle slot's cache. Every check runs before the slot changes, so a
    refused file leaves the slot's own cache as it was."""
    _idle(slot)
    t0 = time.perf_counter()
    image, n_read = read_slot_file(path, model=model_identity(backend.info), state_format=backend.seq_state_format,
                                   n_ctx=slot.n_ctx)
    try:
        backend.import_seq(slot.seq_id, image.state)
    except SpekulaError as exc:
        # import_seq checks the arrays before writing: the slot still holds its own cache
        raise SlotActionError(f"Unable to restore slot {slot.id} from {path.name!r}: {exc}") from None
    except Exception:
        slot.n_cached = 0  # written halfway: its KV no longer matches any tokens
        raise
    n = int(image.tokens.size)
    slot.tokens[:n] = image.tokens
    slot.n_cached = n
    slot.last_used = time.perf_counter()
    return {"id_slot": slot.id, "filename": path.name, "n_restored": n, "n_read": n_read,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def erase_slot(backend: Backend, slot: Slot) -> dict[str, Any]:
    """Forget the idle slot's cache: the next request on it evaluates its whole prompt."""
    _idle(slot)
    n = slot.n_cached
    backend.truncate(slot.seq_id, 0)
    slot.n_cached = 0
    return {"id_slot": slot.id, "n_erased": n}


@dataclass(eq=False)
class _Call:
    """One queued slot action and, once run, its outcome."""

    action: str
    slot_id: int
    path: Path | None
    done: anyio.Event = field(default_factory=anyio.Event)
    result: dict[str, Any] | None = None
    error: Exception | None = None


class SlotActionQueue:
    """The engine's slot actions: callers wait on the loop; the loop runs them between steps, in its worker thread."""

    def __init__(self, wake_loop: Callable[[], None]) -> None:
        self._calls: deque[_Call] = deque()
        self._wake_loop = wake_loop

    def __bool__(self) -> bool:
        return bool(self._calls)

    async def call(self, action: str, slot_id: int, n_slots: int, path: Path | None) -> dict[str, Any]:
        if action not in SLOT_ACTIONS:
            raise SlotActionError(f"Invalid action {action!r}: one of {', '.join(SLOT_ACTIONS)}")
        if not 0 <= slot_id < n_slots:
            raise SlotActionError(f"Invalid slot ID {slot_id}: this server has slots 0..{n_slots - 1}")
        if action != "erase" and path is None:
            raise SlotActionError(f"slot {action} needs a file name")
        call = _Call(action, slot_id, path)
        self._calls.append(call)
        self._wake_loop()
        await call.done.wait()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    async def run_pending(self, backend: Backend, slots: Sequence[Slot]) -> None:
        calls = list(self._calls)
        self._calls.clear()
        try:
            await anyio.to_thread.run_sync(_run, backend, slots, calls)
        finally:
            for call in calls:
                if call.result is None and call.error is None:
                    call.error = SlotActionError("engine stopped before the slot action ran", "unavailable")
                call.done.set()

    def fail_all(self, message: str) -> None:
        while self._calls:
            call = self._calls.popleft()
            call.error = SlotActionError(message, "unavailable")
            call.done.set()


def _run(backend: Backend, slots: Sequence[Slot], calls: list[_Call]) -> None:
    for call in calls:
        slot = slots[call.slot_id]
        try:
            if call.action == "save":
                assert call.path is not None
                call.result = save_slot(backend, slot, call.path)
            elif call.action == "restore":
                assert call.path is not None
                call.result = restore_slot(backend, slot, call.path)
            else:
                call.result = erase_slot(backend, slot)
        except Exception as exc:  # noqa: BLE001 - handed to its caller; the engine goes on serving
            call.error = exc
