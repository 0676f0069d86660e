"""HTTP request bodies -> the shared completion schema (frontends/schema/completion.py).

llama-server and OpenAI clients send more fields than spekula implements: the llama.cpp web UI
sends its whole sampler panel, OpenAI clients send `n`, `logprobs`, `user`. Each such field is
sorted into one of three groups here:
- mapped: an OpenAI name for one of ours (`max_tokens` is `n_predict`);
- accepted at its neutral value only: `tfs_z: 1.0` or `n_indent: 0` change nothing and pass; any
  other value is a 400 naming the field, because ignoring it would give an answer the caller did
  not ask for;
- informational: fields that do not change the output (`model`, `user`) are accepted and ignored.
The sampler fields (`dry_*`, `xtc_*`, `mirostat*`, `typical_p`, `top_n_sigma`, `dynatemp_*`,
`samplers`) are the shared schema's (frontends/schema/completion.py).
Everything else is an unknown field, also a 400 naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from spekula.core.verify.token_probs import MAX_N_PROBS
from spekula.frontends.http.errors import HttpError
from spekula.frontends.schema.reasoning_budget import (
    UNLIMITED,
    ReasoningBudgetError,
    read_budget,
    read_message,
)
from spekula.frontends.schema.template_fields import (
    TEMPLATE_FIELDS,
    TemplateFieldError,
    TemplateFields,
    read_template_fields,
)

# field -> the value that leaves generation unchanged (None: absent/null is neutral too)
NEUTRAL: dict[str, Any] = {
    "tfs_z": 1.0, "n_indent": 0, "t_max_predict_ms": 0, "t_max_prompt_ms": 0,
    "best_of": 1, "echo": False, "lora": None,
    "suffix": None,
}
# Fields that never change the generated tokens here.
INFORMATIONAL = frozenset({
    "model", "penalize_nl", "backend_sampling", "tool_choice",
    "parallel_tool_calls", "metadata", "store", "service_tier", "reasoning_format",
    "id", "cache_reuse",
    # llama.cpp web UI: keep-alive pings for its stream, and its channel for ending reasoning early
    "sse_ping_interval", "reasoning_control",
})
OPENAI_MAPPED = {"max_tokens": "n_predict", "max_completion_tokens": "n_predict", "typ_p": "typical_p"}
MAX_BODY_DEFAULT = 32 * 1024 * 1024
TOP_LOGPROBS_MAX = 20  # OpenAI's bound for chat


def _flag(name: str, value: Any, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HttpError(f"'{name}' must be true or false")
    return value


def _is_neutral(name: str, value: Any) -> bool:
    want = NEUTRAL[name]
    if value is None:
        return True
    if name == "lora":
        return not value  # {} / [] change nothing
    if name == "suffix":
        return value == ""
    if isinstance(want, bool):
        return value is want
    if isinstance(want, str):
        return value == want
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and float(value) == float(want))


@dataclass(slots=True)
class HttpOptions:
    """The HTTP-only request fields, next to what rpc_params parses."""

    include_usage: bool = False  # OpenAI stream_options.include_usage
    n: int = 1  # OpenAI `n` (llama-server's n_cmpl): completions of the same prompt, each in its own slot
    verbose: bool = False  # llama-server's `__verbose`: the native result (rendered prompt included) too
    user: str | None = None  # OpenAI `user`: never changes the output; keeps a client on one replica (Ray)
    logprobs: int | None = None  # OpenAI `logprobs` (+ chat's `top_logprobs`): alternatives per token; None: off
    # chat: add_generation_prompt, continue_final_message, tools and chat_template_kwargs for the template
    template: TemplateFields = field(default_factory=TemplateFields)
    return_progress: bool = False  # streamed: llama-server's prompt_progress events while the prompt is processed
    timings_per_token: bool = False  # streamed: the timings so far on every event
    reasoning_budget: int = UNLIMITED  # chat: reasoning_budget_tokens / thinking_budget_tokens (-1: the server's)
    reasoning_budget_message: str | None = None  # chat: forced before the end tag when the budget runs out (None: the server's)


def normalise(body: Any, *, allowed: frozenset[str], n_slots: int) -> tuple[dict[str, Any], HttpOptions]:
    """Split a request body into the shared schema's fields and the HTTP options; every field is
    checked (mapped, neutral, informational or known), so nothing is silently dropped."""
    if not isinstance(body, dict):
        raise HttpError("request body must be a JSON object")
    params: dict[str, Any] = {}
    opts = HttpOptions()
    for name, value in body.items():
        if name in OPENAI_MAPPED:
            if value is not None:
                params[OPENAI_MAPPED[name]] = value
        elif name in NEUTRAL:
            if not _is_neutral(name, value):
                raise HttpError(f"'{name}' = {json.dumps(value)[:80]} is not supported by spekula "
                                f"(accepted only at {NEUTRAL[name]!r}, which changes nothing)")
        elif name == "stream_options":
            if value is not None:
                if not isinstance(value, dict) or not set(value) <= {"include_usage"}:
                    raise HttpError("'stream_options' must be an object with at most 'include_usage'")
                opts.include_usage = _flag("stream_options.include_usage", value.get("include_usage"), False)
        elif name == "user":
            if value is not None and not isinstance(value, str):
                raise HttpError("'user' must be a string")
            opts.user = value or None
        elif name == "verbose":
            opts.verbose = _flag(name, value, False)
        elif name in TEMPLATE_FIELDS:
            if name == "tools" and value and "messages" not in allowed:
                raise HttpError("'tools' needs a chat request (/v1/chat/completions)")
        elif name in ("n", "n_cmpl"):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= n_slots:
                    raise HttpError(f"'{name}' must be an integer in [1, {n_slots}] (the server's slots)")
                opts.n = value
        elif name in ("return_progress", "timings_per_token"):
            setattr(opts, name, _flag(name, value, False))
        elif name in ("logprobs", "top_logprobs"):
            _logprobs_field(opts, name, value, chat="messages" in allowed)
        elif name == "reasoning_effort":
            if value is not None and (not isinstance(value, str) or "messages" not in allowed):
                raise HttpError("'reasoning_effort' must be a string, in a chat request")
        elif name in ("reasoning_budget_tokens", "thinking_budget_tokens"):
            if value is not None:
                if "messages" not in allowed and value != UNLIMITED:
                    raise HttpError(f"'{name}' needs a chat request (/v1/chat/completions)")
                try:
                    opts.reasoning_budget = read_budget(value, f"'{name}'")
                except ReasoningBudgetError as exc:
                    raise HttpError(str(exc)) from None
        elif name == "reasoning_budget_message":
            if value is not None:
                if "messages" not in allowed:
                    raise HttpError(f"'{name}' needs a chat request (/v1/chat/completions)")
                try:
                    opts.reasoning_budget_message = read_message(value, f"'{name}'")
                except ReasoningBudgetError as exc:
                    raise HttpError(str(exc)) from None
        elif name in INFORMATIONAL:
            pass
        elif name in allowed:
            if value is not None or name in ("prompt", "messages"):
                params[name] = value
        else:
            raise HttpError(f"unknown field '{str(name)[:80]}'")
    try:
        opts.template = read_template_fields(body)
    except TemplateFieldError as exc:
        raise HttpError(str(exc)) from None
    effort, variables = body.get("reasoning_effort"), opts.template.template_kwargs
    if effort == "none":  # OpenAI's "no reasoning": the template's thinking switch, as llama-server reads it
        variables["enable_thinking"] = False
        variables.pop("reasoning_effort", None)
    elif effort:
        variables["reasoning_effort"] = effort
    if "messages" in allowed and body.get("logprobs") is not True:
        if body.get("top_logprobs"):
            raise HttpError("'top_logprobs' needs 'logprobs': true")
        opts.logprobs = None  # `top_logprobs: 0` alone asks for nothing
    return params, opts


def _logprobs_field(opts: HttpOptions, name: str, value: Any, *, chat: bool) -> None:
    """OpenAI's fields: chat takes `logprobs: true` and `top_logprobs: 0..20`, completions take
    `logprobs: N` (the alternatives per token)."""
    if value is None:
        return
    if name == "logprobs" and chat:
        if not isinstance(value, bool):
            raise HttpError("'logprobs' must be true or false")
        if value:
            opts.logprobs = opts.logprobs or 0
        return
    if name == "top_logprobs" and not chat:
        raise HttpError("'top_logprobs' is a chat field; completions take 'logprobs': N")
    top = TOP_LOGPROBS_MAX if name == "top_logprobs" else MAX_N_PROBS
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise HttpError(f"'{name}' must be an integer in [0, {top}]")
    opts.logprobs = value
