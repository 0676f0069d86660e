"""Per-slot state for drafters: one drafter instance serves every slot of an engine, so each keeps
what belongs to one request (a KV sequence, counters, a sampler) in a `SlotStates`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class SlotStates(Generic[T]):
    """slot id -> state, created on first use by `factory(slot)` (or set with `put`)."""

    def __init__(self, factory: Callable[[int], T] | None = None) -> None:
        self._factory = factory
        self._states: dict[int, T] = {}

    def get(self, slot: int) -> T:
        """The slot's state, created if it has none yet (KeyError without a factory)."""
        st = self._states.get(slot)
        if st is None:
            if self._factory is None:
                raise KeyError(f"slot {slot} has no state")
            st = self._states[slot] = self._factory(slot)
        return st

    def put(self, slot: int, state: T) -> None:
        self._states[slot] = state

    def peek(self, slot: int) -> T | None:
        """The slot's state if it has one (never creates)."""
        return self._states.get(slot)

    def pop(self, slot: int) -> T | None:
        """Forget the slot's state and return it (to free what it holds)."""
        return self._states.pop(slot, None)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._states.values()))

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, slot: object) -> bool:
        return slot in self._states
