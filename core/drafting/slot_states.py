"""Per-slot state for drafters: one drafter instance serves every slot of an engine, so each keeps
what belongs to one request (a KV sequence, counters, a sampler) in a `SlotStates`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

import numpy as np

from spekula.core.errors import ConfigError

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


def state_array(arrays: Mapping[str, np.ndarray], name: str, dtype: type, shape: tuple[int | None, ...]) -> np.ndarray:
    """`arrays[name]` (a saved slot state's, see Drafter.load_slot) checked to be `dtype` of `shape` (None: any
    size on that axis); a ConfigError naming what is wrong otherwise."""
    arr = arrays.get(name)
    if arr is None:
        raise ConfigError(f"the saved slot state has no {name!r}")
    if arr.dtype != np.dtype(dtype) or arr.ndim != len(shape) or any(
            want is not None and got != want for got, want in zip(arr.shape, shape, strict=True)):
        raise ConfigError(f"the saved slot state's {name!r} is {arr.dtype} {arr.shape}, not {np.dtype(dtype)} "
                          f"{tuple('*' if d is None else d for d in shape)}")
    return arr
