"""llama-server's `samplers` request field: which samplers run, in which order.

spekula's chain is fixed: logit bias, penalties, top-k, top-p, min-p, temperature, then the draw.
A request may leave samplers out (each one left out then does nothing, whatever its parameter
says, as in llama-server) but not reorder them, because a different order gives a different
distribution. DRY, typical-p, XTC and top-n-sigma are accepted anywhere: spekula runs them only at
their neutral settings, where they change nothing. The field is an array of names (llama.cpp's,
with its aliases) or a string of one-letter codes, as the llama.cpp web UI sends it.
"""

from __future__ import annotations

from typing import Any

from spekula.frontends.http.errors import HttpError

CHAIN = ("penalties", "top_k", "top_p", "min_p", "temperature")
NEUTRAL_ONLY = frozenset({"dry", "typ_p", "xtc", "top_n_sigma"})  # off unless their own fields turn them on
UNSUPPORTED = frozenset({"infill", "adaptive_p"})
_CANONICAL = (*CHAIN, *sorted(NEUTRAL_ONLY), *sorted(UNSUPPORTED))
_NAMES: dict[str, str] = {
    **{n: n for n in _CANONICAL},
    **{n.replace("_", "-"): n for n in _CANONICAL if "_" in n},
    **{n.replace("_", ""): n for n in _CANONICAL if "_" in n},
    "nucleus": "top_p", "temp": "temperature", "typ": "typ_p",
}
_CHARS = {"e": "penalties", "k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature", "d": "dry",
          "y": "typ_p", "x": "xtc", "s": "top_n_sigma", "i": "infill", "a": "adaptive_p"}
# What a sampler left out of the chain amounts to.
_OFF: dict[str, dict[str, Any]] = {
    "penalties": {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0},
    "top_k": {"top_k": 0},
    "top_p": {"top_p": 1.0},
    "min_p": {"min_p": 0.0},
    "temperature": {"temperature": 1.0},  # no temperature step: the draw is from the plain softmax
}


def sampler_overrides(value: Any) -> dict[str, Any]:
    """The sampling fields that make spekula's chain the one `samplers` names (empty for None)."""
    if value is None:
        return {}
    if isinstance(value, str):
        unknown = sorted({c for c in value if c not in _CHARS})
        if unknown:
            raise HttpError(f"'samplers': unknown sampler code(s) {', '.join(map(repr, unknown))} "
                            f"(codes: {''.join(_CHARS)})")
        names = [_CHARS[c] for c in value]
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        unknown = sorted({n for n in value if n.lower() not in _NAMES})
        if unknown:
            raise HttpError(f"'samplers': unknown sampler(s) {', '.join(map(repr, unknown))}")
        names = [_NAMES[n.lower()] for n in value]
    else:
        raise HttpError("'samplers' must be a list of sampler names or a string of sampler codes")
    refused = sorted(set(names) & UNSUPPORTED)
    if refused:
        raise HttpError(f"'samplers': {', '.join(refused)} is not supported by spekula")
    chain = [n for n in names if n in CHAIN]
    if len(set(chain)) != len(chain) or chain != [n for n in CHAIN if n in chain]:
        raise HttpError(f"'samplers': spekula applies its samplers in one order ({', '.join(CHAIN)}); "
                        f"some may be left out, but not reordered or repeated (got {', '.join(chain) or 'none'})")
    out: dict[str, Any] = {}
    for name in CHAIN:
        if name not in chain:
            out.update(_OFF[name])
    return out
