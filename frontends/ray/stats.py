"""Several engines' statistics as one: what /metrics and /health report across Ray replicas.

Counters and per-position tables add up; the largest sequence seen is the largest of any replica;
ratios are recomputed from the summed counters (a mean of means would weigh an idle replica like a
busy one); the adaptive gains are weighted by each replica's adapted rounds.
"""

from __future__ import annotations

from typing import Any

_LARGEST = frozenset({"n_tokens_max"})
_GAINS = ("predicted_gain", "measured_gain")


def _add(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, dict):
        return merge_dicts(present)
    if isinstance(first, list):
        out: list[Any] = []
        for v in present:
            for i, x in enumerate(v):
                if i < len(out):
                    out[i] += x
                else:
                    out.append(x)
        return out
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    return sum(present)


def merge_dicts(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    keys: dict[str, None] = {}
    for d in dicts:
        keys.update(dict.fromkeys(d))
    out: dict[str, Any] = {}
    for key in keys:
        values = [d.get(key) for d in dicts]
        if key in _LARGEST:
            out[key] = max((v for v in values if v is not None), default=0)
        elif key in _GAINS:
            weights = [float(d.get("rounds") or 0) for d in dicts]
            total = sum(weights)
            out[key] = sum(w * float(v or 0.0) for w, v in zip(weights, values, strict=True)) / total if total else 0.0
        else:
            out[key] = _add(values)
    return out


def merge_snapshots(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """Engine.stats() of several engines -> one snapshot of the same shape."""
    out = merge_dicts(snaps)
    hist = out.get("histogram") or []
    rounds = sum(hist)
    out["n_rounds"] = rounds
    out["mean_acc_len"] = 1.0 + sum(n * c for n, c in enumerate(hist)) / rounds if rounds else 0.0
    for st in (out.get("drafters") or {}).values():
        calls = st.get("calls_accept") or 0
        st["mean_acc_len"] = 1.0 + st.get("acc_tokens", 0) / calls if calls else 1.0
    return out
