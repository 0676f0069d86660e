"""Synthetic acceptance for benchmarks (docs/semantics.md §1.5): accept drafts at chosen rates instead of by the target.

`--spec-synth-rates r0..r(K-1)` gives the *unconditional* probability that the first i+1 drafts are
all accepted; `--spec-synth-len L` asks for a mean acceptance length L (target token included) and is
turned into geometric rates p, p², ..., p^K. The verifier needs the *conditional* rates
c_i = r_i / r_(i-1). The generated text is not valid output: this only measures the engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from spekula.core.errors import ConfigError
from spekula.core.verify.verifier import verify_synthetic

__all__ = ["conditional_rates", "mean_length", "resolve_synthetic_rates", "verify_synthetic"]


def _geometric_p(n_max: int, length: float) -> float:
    """p with Σ_{j=1..K} p^j = L - 1, by llama.cpp's 32 bisection steps (so the rates match exactly)."""
    if length == n_max + 1.0:
        return 1.0
    if length <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(32):
        mid = 0.5 * (lo + hi)
        total, term = 0.0, mid
        for _j in range(n_max):
            total += term
            term *= mid
        if total < length - 1.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def resolve_synthetic_rates(
    n_max_eff: int, rates: Sequence[float] | None, length: float | None
) -> tuple[float, ...] | None:
    """Validate the synthetic options and return the unconditional rates r_0..r_(K-1), or None when off.

    K = n_max_eff is the effective draft cap (max over the created drafters). Both options at once,
    K <= 0, a wrong count, a non-finite or out-of-range rate, an increasing sequence, or L outside
    [1, K+1] are ConfigErrors.
    """
    has_rates = rates is not None and len(rates) > 0
    has_length = length is not None
    if not has_rates and not has_length:
        return None
    if has_rates and has_length:
        raise ConfigError("--spec-synth-len and --spec-synth-rates are mutually exclusive; give one")
    if n_max_eff <= 0:
        raise ConfigError(
            "synthetic acceptance needs at least one speculative token: no configured drafter drafts "
            f"(effective n_max = {n_max_eff})"
        )
    if has_rates:
        assert rates is not None
        values = [float(r) for r in rates]
        if len(values) != n_max_eff:
            raise ConfigError(
                f"--spec-synth-rates must contain {n_max_eff} values (the effective draft n_max), got {len(values)}"
            )
        for i, r in enumerate(values):
            if not math.isfinite(r) or not 0.0 <= r <= 1.0:
                raise ConfigError(f"--spec-synth-rates value #{i} = {r} must be finite and within [0, 1]")
            if i > 0 and r > values[i - 1]:
                raise ConfigError(
                    f"--spec-synth-rates must be non-increasing (each is P(first i+1 drafts accepted)); "
                    f"value #{i} = {r} > #{i - 1} = {values[i - 1]}"
                )
        return tuple(values)

    assert length is not None
    length_max = n_max_eff + 1.0
    if not math.isfinite(length) or not 1.0 <= length <= length_max:
        raise ConfigError(f"--spec-synth-len must be finite and within [1, {length_max:.0f}]; got {length}")
    p = _geometric_p(n_max_eff, float(length))
    out: list[float] = []
    rate = p
    for _ in range(n_max_eff):
        out.append(rate)
        rate *= p
    return tuple(out)


def conditional_rates(rates: Sequence[float]) -> tuple[float, ...]:
    """c_0 = r_0, c_i = r_i / r_(i-1) (0 once a rate reaches 0): what verify_synthetic takes."""
    out: list[float] = []
    prev = 1.0
    for r in rates:
        out.append(r / prev if prev > 0.0 else 0.0)
        prev = r
    return tuple(out)


def mean_length(rates: Sequence[float]) -> float:
    """Expected tokens per round with full-length drafts: 1 + Σ r_i (logged at start-up)."""
    return 1.0 + float(sum(rates))
