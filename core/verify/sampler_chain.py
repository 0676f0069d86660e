"""llama.cpp's `samplers` chain: which stages run, in which order, by name or one-letter code.

Logit bias always runs first and the draw last; between them the stages run in the order given,
each as many times as it is named; a stage left out does nothing whatever its parameter says.
Mirostat (mirostat 1 or 2) ignores the chain, as in llama.cpp: its chain is temperature then Mirostat.
"""

from __future__ import annotations

from collections.abc import Sequence

from spekula.core.errors import ConfigError
from spekula.core.params import DEFAULT_SAMPLERS

STAGES = frozenset(DEFAULT_SAMPLERS)
UNSUPPORTED = frozenset({"infill", "adaptive_p"})  # llama.cpp's, absent from spekula
_CANONICAL = (*DEFAULT_SAMPLERS, *sorted(UNSUPPORTED))
NAMES: dict[str, str] = {
    **{n: n for n in _CANONICAL},
    **{n.replace("_", "-"): n for n in _CANONICAL if "_" in n},
    **{n.replace("_", ""): n for n in _CANONICAL if "_" in n},
    "nucleus": "top_p", "temp": "temperature", "typ": "typ_p",
}
CHARS: dict[str, str] = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                         "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill", "a": "adaptive_p"}
MAX_STAGES = 64


def _checked(names: list[str]) -> tuple[str, ...]:
    refused = sorted(set(names) & UNSUPPORTED)
    if refused:
        raise ConfigError(f"samplers: {', '.join(refused)} is not supported by spekula")
    if len(names) > MAX_STAGES:
        raise ConfigError(f"samplers: at most {MAX_STAGES} stages; got {len(names)}")
    return tuple(names)


def samplers_from_names(names: Sequence[str]) -> tuple[str, ...]:
    """A list of stage names (llama.cpp's, their aliases, case-insensitive) -> canonical names."""
    unknown = [n for n in names if n.lower() not in NAMES]
    if unknown:
        raise ConfigError(f"samplers: unknown sampler(s) {', '.join(repr(n)[:40] for n in unknown[:8])} "
                          f"(names: {', '.join(DEFAULT_SAMPLERS)})")
    return _checked([NAMES[n.lower()] for n in names])


def samplers_from_chars(codes: str) -> tuple[str, ...]:
    """A string of one-letter codes (the llama.cpp web UI's form, e.g. "edskypmxt") -> canonical names."""
    unknown = sorted({c for c in codes if c not in CHARS})
    if unknown:
        raise ConfigError(f"samplers: unknown sampler code(s) {', '.join(map(repr, unknown))} "
                          f"(codes: {''.join(CHARS)})")
    return _checked([CHARS[c] for c in codes])
