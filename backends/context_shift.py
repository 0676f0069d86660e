"""What every backend checks before a context shift (core/backend.py's `shift`): which models a shift
cannot keep exact, and the bounds of one shift.

A shift removes positions [n_keep, n_keep + n_discard) of a sequence and moves the rest down, re-roping
their keys. That is exact only for blocks whose every cached key is a roped function of its own token
and position. Two kinds of block are not:

* a recurrent (gated delta-net) state summarises every position so far, so a middle span cannot be
  taken out of it (llama.cpp turns context shift off for these models too);
* a sliding-window block keeps only its window's keys in a ring: after a shift the window would reach
  back over positions the ring has already dropped. llama.cpp shifts such caches anyway and then
  attends over fewer keys than recomputation would; spekula refuses rather than differ from its own
  recomputation.
"""

from __future__ import annotations

from spekula.backends.gguf.architecture import ModelHParams
from spekula.core.errors import ConfigError


def shift_refusal(hp: ModelHParams, runtime: str) -> str | None:
    """Why `runtime` cannot shift this model's context, or None when it can."""
    if hp.is_hybrid:
        return (f"context shift is not supported for {hp.arch}: its recurrent (gated delta-net) state cannot "
                "drop a span of positions")
    if any(hp.swa_layers):
        return (f"context shift is not supported for {hp.arch} by {runtime}: its sliding-window blocks keep only "
                "the window's keys, so a shift cannot match recomputation")
    return None


def check_shift(n_keep: int, n_discard: int, length: int) -> None:
    """The bounds of one shift of a sequence holding `length` positions (ConfigError when outside)."""
    if n_keep < 0 or n_discard < 0 or n_keep + n_discard > length:
        raise ConfigError(f"context shift: n_keep {n_keep} and n_discard {n_discard} must be >= 0 and fit the "
                          f"sequence's {length} positions")
