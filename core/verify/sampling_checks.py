"""The sampling parameters' ranges, checked when a request's sampler is built.

The frontends check the same ranges field by field (frontends/schema/completion.py) so a bad value
is a 400 naming the field; these checks hold for every caller of the core (the CLI, the RPC socket,
tests), each a ConfigError naming the parameter.
"""

from __future__ import annotations

import math

from spekula.core.errors import ConfigError
from spekula.core.params import SamplingParams
from spekula.core.verify.sampler_chain import STAGES, UNSUPPORTED

MAX_DRY_BREAKERS = 32  # each is looked for in every token's text once per distinct list


def _in(name: str, value: float, lo: float, hi: float) -> None:
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ConfigError(f"sampling parameter {name} must be in [{lo}, {hi}]; got {value}")


def validate(params: SamplingParams) -> None:
    for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
                 "top_n_sigma", "dry_multiplier", "dry_base", "dynatemp_range", "dynatemp_exponent",
                 "mirostat_tau", "mirostat_eta", "xtc_probability", "xtc_threshold", "typical_p"):
        value = getattr(params, name)
        if not math.isfinite(value):
            raise ConfigError(f"sampling parameter {name} must be finite; got {value}")
    if params.repeat_penalty <= 0.0:
        raise ConfigError(f"repeat_penalty must be > 0; got {params.repeat_penalty}")
    if not -1 <= params.repeat_last_n < 2**31:
        raise ConfigError(f"repeat_last_n must be in [-1, 2^31); got {params.repeat_last_n}")
    for token, bias in params.logit_bias:
        if not math.isfinite(bias) and bias != -math.inf:
            raise ConfigError(f"logit_bias for token {token} must be finite or -inf (a ban); got {bias}")
    if not -(2**31) <= params.top_k < 2**31:
        raise ConfigError(f"top_k must be a 32-bit integer; got {params.top_k}")
    if not 0 <= params.min_keep < 2**31:
        raise ConfigError(f"min_keep must be in [0, 2^31); got {params.min_keep}")
    _in("dry_multiplier", params.dry_multiplier, 0.0, 1e6)
    if params.dry_base < 1.0:
        raise ConfigError(f"dry_base must be >= 1; got {params.dry_base}")
    for name in ("dry_allowed_length", "dry_penalty_last_n"):
        if not 0 <= getattr(params, name) < 2**31:
            raise ConfigError(f"{name} must be in [0, 2^31); got {getattr(params, name)}")
    breakers = params.dry_sequence_breakers
    if len(breakers) > MAX_DRY_BREAKERS or not all(isinstance(b, str) for b in breakers):
        raise ConfigError(f"dry_sequence_breakers must be at most {MAX_DRY_BREAKERS} strings; got {len(breakers)} entries")
    _in("xtc_probability", params.xtc_probability, 0.0, 1.0)
    _in("xtc_threshold", params.xtc_threshold, 0.0, 1.0)
    _in("typical_p", params.typical_p, 0.0, 1.0)
    _in("dynatemp_range", params.dynatemp_range, 0.0, 100.0)
    _in("dynatemp_exponent", params.dynatemp_exponent, 0.0, 100.0)
    if params.mirostat not in (0, 1, 2):
        raise ConfigError(f"mirostat must be 0 (off), 1 or 2; got {params.mirostat}")
    _in("mirostat_tau", params.mirostat_tau, 0.0, 100.0)
    _in("mirostat_eta", params.mirostat_eta, 0.0, 100.0)
    bad = [s for s in params.samplers if s not in STAGES]
    if bad:
        what = "is not supported by spekula" if set(bad) <= UNSUPPORTED else "is not a sampler"
        raise ConfigError(f"samplers: {', '.join(map(repr, bad))} {what} (stages: {', '.join(sorted(STAGES))})")
