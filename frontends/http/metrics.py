"""/metrics in Prometheus text format (0.0.4), with llama-server's metric names (`llamacpp:*`).

Rendered by hand rather than through prometheus-client: llama-server's names include a counter
without the `_total` suffix (`n_tokens_max`) that the client library would rename, and users'
dashboards key on the exact names. The tests parse the output with prometheus-client's parser.
Values are read from the engine's own counters at scrape time. On top of llama-server's
engine-wide speculative counters, `llamacpp:spec_decode_drafter_*` carry the same counts per
drafter under a `drafter` label (a labelled and an unlabelled series cannot share one name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spekula.frontends.http.serving_engine import ServingEngine

P = "llamacpp:"


def _family(lines: list[str], name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
    lines.append(f"# HELP {P}{name} {doc}")
    lines.append(f"# TYPE {P}{name} {kind}")
    for labels, value in samples:
        lines.append(f"{P}{name}{labels} {float(value)!r}")


def _label(**kw: str) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in kw.items()) + "}"


def render(engine: ServingEngine) -> bytes:
    snap: dict[str, Any] = engine.stats()
    drafters: dict[str, dict[str, Any]] = snap["drafters"]
    health = engine.health()
    prompt_s, predicted_s = snap["t_prompt_ms"] / 1e3, snap["t_predicted_ms"] / 1e3
    lines: list[str] = []
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", snap["n_prompt_tokens"]),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", snap["n_cache_tokens"]),
        ("prompt_seconds_total", "Total time spent processing prompts", prompt_s),
        ("tokens_predicted_total", "Number of generation tokens processed", snap["n_tokens_predicted"]),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", predicted_s),
        ("n_decode_total", "Total number of target forwards", snap["n_forwards"]),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", snap["n_tokens_max"]),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
         sum(d["gen_tokens"] for d in drafters.values())),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
         sum(d["acc_tokens"] for d in drafters.values())),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
         sum(d["gen_drafts"] for d in drafters.values())),
    ]
    for name, doc, value in counters:
        _family(lines, name, "counter", doc, [("", value)])
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
         snap["n_prompt_tokens"] / prompt_s if prompt_s > 0 else 0.0),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         snap["n_tokens_predicted"] / predicted_s if predicted_s > 0 else 0.0),
        ("requests_processing", "Number of requests processing", health["slots_busy"]),
        ("requests_deferred", "Number of requests deferred", health["queued"]),
        ("n_busy_slots_per_decode", "Average number of busy slots per target forward",
         snap["n_forward_seqs"] / max(snap["n_forwards"], 1)),
    ]
    for name, doc, value in gauges:
        _family(lines, name, "gauge", doc, [("", value)])
    if snap["acc_per_pos"]:
        _family(lines, "spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted tokens per draft position",
                [(_label(position=str(i)), v) for i, v in enumerate(snap["acc_per_pos"])])
    if drafters:
        for key, name, doc in (("gen_drafts", "num_drafts_total", "verification steps"),
                               ("gen_tokens", "num_draft_tokens_total", "draft tokens generated"),
                               ("acc_tokens", "num_accepted_tokens_total", "draft tokens accepted")):
            _family(lines, f"spec_decode_drafter_{name}", "counter", f"Speculative: {doc}, per drafter",
                    [(_label(drafter=d), st[key]) for d, st in drafters.items()])
        _family(lines, "spec_decode_drafter_num_accepted_tokens_per_pos_total", "counter",
                "Accepted tokens per drafter and draft position",
                [(_label(drafter=d, position=str(i)), v) for d, st in drafters.items()
                 for i, v in enumerate(st["acc_per_pos"])])
    return ("\n".join(lines) + "\n").encode()
