"""llama.cpp's `samplers` chain: which stages run, in which order, by name or one-letter code.

Logit bias always runs first and the draw last; between them the stages run in the order given,
each as many times as it is named; a stage left out does nothing whatever its parameter says.
Mirostat (mirostat 1 or 2) ignores the chain, as in llama.cpp: its chain is temperature then Mirostat.
`effective_params` folds the chain into the parameters (a stage left out at its neutral value) and
`fast_path` says whether sampling.py's fast path runs it.
"""

from __future__ import annotations

from collections.abc import Sequence

from spekula.core.errors import ConfigError
from spekula.core.params import DEFAULT_SAMPLERS, SamplingParams

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
# The fast path's stages in its order, and what each amounts to when `samplers` leaves it out.
CLASSIC = ("penalties", "top_k", "top_p", "min_p", "temperature")
_OFF: dict[str, dict[str, object]] = {
    "penalties": {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
    "top_k": {"top_k": 0},
    "top_p": {"top_p": 1.0},
    "min_p": {"min_p": 0.0},
    "temperature": {"temperature": 1.0, "dynatemp_range": 0.0},  # no temperature stage: the plain softmax
    "dry": {"dry_multiplier": 0.0},
    "top_n_sigma": {"top_n_sigma": -1.0},
    "typ_p": {"typical_p": 1.0},
    "xtc": {"xtc_probability": 0.0},
}


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


def effective_params(params: SamplingParams) -> SamplingParams:
    """The parameters as the chain applies them: a stage `samplers` leaves out at its neutral value
    (Mirostat keeps its temperature: its chain ignores `samplers`)."""
    off: dict[str, object] = {}
    for name, neutral in _OFF.items():
        if name not in params.samplers and not (params.mirostat and name == "temperature"):
            off.update(neutral)
    return params.with_(**off) if off else params


def uses_dry(params: SamplingParams) -> bool:
    """Whether the chain runs DRY (which needs the sequence breakers as tokens)."""
    e = effective_params(params)
    return not e.mirostat and e.dry_multiplier != 0.0 and e.dry_penalty_last_n > 0


def fast_path(p: SamplingParams) -> bool:
    """Whether the chain is only classic stages, each at most once, in the classic order."""
    if p.mirostat or p.dry_multiplier != 0.0 or p.top_n_sigma > 0.0 or p.typical_p < 1.0 or p.dynatemp_range > 0.0:
        return False
    if p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5:
        return False
    chain = [s for s in p.samplers if s in CLASSIC]
    return len(set(chain)) == len(chain) and chain == [s for s in CLASSIC if s in chain]
