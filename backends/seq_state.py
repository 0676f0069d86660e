"""Checks every backend runs on a sequence state before importing it (core/backend.py: export_seq /
import_seq), so a state that does not fit changes nothing."""

from __future__ import annotations

import numpy as np

from spekula.core.backend import SeqState
from spekula.core.errors import ConfigError

ExpectedArrays = dict[str, tuple[np.dtype, tuple[int, ...]]]


def check_state_arrays(state: SeqState, expected: ExpectedArrays) -> None:
    """A ConfigError unless `state` holds exactly the arrays named in `expected`, of those dtypes and shapes."""
    if set(state.arrays) != set(expected):
        raise ConfigError(f"the state holds {sorted(state.arrays)}; this model's sequences hold {sorted(expected)}")
    for name, (dtype, shape) in expected.items():
        arr = state.arrays[name]
        if arr.dtype != dtype or tuple(arr.shape) != shape:
            raise ConfigError(f"the state's {name} is {arr.dtype} {tuple(arr.shape)}; this model's is {dtype} {shape}")
