"""Request parameters in llama-server's /completion vocabulary -> a validated CompletionRequest.

The one schema every frontend shares: each field's type and explicit range live in RANGES below,
and every rejection is a ParamError naming the field (-32602 on the socket; an HTTP layer maps the
same error to 400), so a client sees `'top_k' must be an integer` rather than a traceback or an
engine error. Unknown fields are rejected too: a misspelt `temprature` silently ignored would produce
a different answer than the caller asked for.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from spekula.core.drafting.registry import parse_spec_types
from spekula.core.errors import ConfigError
from spekula.core.modelfile.constraint import GrammarSpec
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.verify.sampler_chain import samplers_from_chars, samplers_from_names
from spekula.core.verify.sampling import banning_end_of_generation
from spekula.core.verify.sampling_checks import MAX_DRY_BREAKERS
from spekula.core.verify.token_probs import MAX_N_PROBS
from spekula.frontends.rpc.protocol import CONTEXT_OVERFLOW, RpcError
from spekula.frontends.schema.chat_messages import MessagesError, chat_messages
from spekula.frontends.schema.errors import invalid_params

I32_MAX = 2**31 - 1
# Every numeric request field with its inclusive range. Beyond these a value is refused before it
# reaches the engine (a repeat_last_n of 2^63, say, would overflow the penalty window).
RANGES: dict[str, tuple[float, float]] = {
    "n_predict": (-1, I32_MAX),
    "temperature": (-100.0, 100.0),  # <= 0 is greedy
    "top_k": (-1, I32_MAX),  # <= 0 disables top-k
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repeat_penalty": (1e-6, 100.0),
    "presence_penalty": (-100.0, 100.0),
    "frequency_penalty": (-100.0, 100.0),
    "repeat_last_n": (-1, I32_MAX),  # -1: the whole context
    "seed": (-1, 2**32 - 1),  # -1: random
    "id_slot": (-1, I32_MAX),  # -1: any slot; the engine's slot count bounds it further
    "speculative.n_max": (0, 1024),
    "speculative.n_min": (0, 1024),
    "speculative.p_min": (0.0, 1.0),
    "n_probs": (0, MAX_N_PROBS),
    "min_keep": (0, I32_MAX),  # alternatives listed per emitted token
    "dry_multiplier": (0.0, 1e6),  # 0: DRY off
    "dry_base": (1.0, 1e6),
    "dry_allowed_length": (0, I32_MAX),
    "dry_penalty_last_n": (0, I32_MAX),  # 0: DRY off
    "xtc_probability": (0.0, 1.0),
    "xtc_threshold": (0.0, 1.0),  # > 0.5: XTC off
    "typical_p": (0.0, 1.0),  # 1: off
    "top_n_sigma": (-100.0, 100.0),  # <= 0: off
    "dynatemp_range": (0.0, 100.0),
    "dynatemp_exponent": (0.0, 100.0),
    "mirostat": (0, 2),
    "mirostat_tau": (0.0, 100.0),
    "mirostat_eta": (0.0, 100.0),
    "n_keep": (-1, I32_MAX),  # context shift: tokens kept (-1: the prompt); the context bounds it further
    "n_discard": (0, I32_MAX),  # context shift: tokens dropped (0: half); the context bounds it further
}
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_TOKEN_LIST = 16_777_216


FLOAT_SAMPLING = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
                  "dry_multiplier", "dry_base", "xtc_probability", "xtc_threshold", "typical_p", "top_n_sigma",
                  "dynatemp_range", "dynatemp_exponent", "mirostat_tau", "mirostat_eta")
INT_SAMPLING = ("top_k", "repeat_last_n", "seed", "min_keep", "dry_allowed_length", "dry_penalty_last_n", "mirostat")
SAMPLING_FIELDS = (*FLOAT_SAMPLING, *INT_SAMPLING, "logit_bias", "dry_sequence_breakers", "samplers")
SPEC_FIELDS = ("n_max", "n_min", "p_min", "type", "adaptive")
GRAMMAR_FIELDS = ("grammar", "json_schema", "response_format")
COMPLETION_FIELDS = frozenset(
    {"prompt", "n_predict", "stop", "stream", "return_tokens", "ignore_eos", "speculative", "cache_prompt", "id_slot",
     "n_probs", "post_sampling_probs", "n_keep", "n_discard", *SAMPLING_FIELDS, *GRAMMAR_FIELDS}
    | {f"speculative.{f}" for f in SPEC_FIELDS}
)
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt"}) | {"messages"}


@dataclass(frozen=True, slots=True)
class ServerDefaults:
    """Generation defaults a request inherits (from the serve command line)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1
    prefill_assistant: bool = True  # a chat ending with an assistant message continues it (--no-prefill-assistant)
    reasoning_format: str = "auto"  # chat replies: <think> into reasoning_content unless "none" (--reasoning-format)
    n_keep: int = 0  # --keep: tokens a context shift keeps (-1: the whole prompt)
    reasoning_budget: int = -1  # --reasoning-budget: -1 unlimited, 0 none, N tokens (frontends/schema/reasoning_budget.py)
    reasoning_budget_message: str = ""  # --reasoning-budget-message: forced before the end tag when a budget runs out


@dataclass(slots=True)
class ParsedCompletion:
    request: CompletionRequest
    stream: bool
    return_tokens: bool
    grammar_field: str = "grammar"  # the field the request's grammar came from, for error messages


def as_object(params: Any, method: str) -> dict[str, Any]:
    """Our methods take named parameters only."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise invalid_params(f"{method}: params must be an object with named fields", "params")
    return params


def reject_unknown(params: dict[str, Any], allowed: frozenset[str] | set[str], method: str) -> None:
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise invalid_params(f"{method}: unknown field(s) {', '.join(repr(u)[:80] for u in unknown[:8])}", unknown[0])


def get_int(params: dict[str, Any], name: str, default: int) -> int:
    """An integer field within RANGES[name]."""
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_params(f"'{name}' must be an integer", name)
    lo, hi = RANGES[name]
    if not lo <= value <= hi:
        raise invalid_params(f"'{name}' must be in [{int(lo)}, {int(hi)}], got {value}", name)
    return value


def get_float(params: dict[str, Any], name: str, default: float) -> float:
    """A finite number within RANGES[name]."""
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid_params(f"'{name}' must be a finite number", name)
    lo, hi = RANGES[name]
    if not lo <= value <= hi:
        raise invalid_params(f"'{name}' must be in [{lo}, {hi}], got {value}", name)
    return float(value)


def get_bool(params: dict[str, Any], name: str, default: bool) -> bool:
    value = params.get(name, default)
    if not isinstance(value, bool):
        raise invalid_params(f"'{name}' must be true or false", name)
    return value


def get_token_list(value: Any, name: str, n_vocab: int) -> list[int]:
    # the length first: a list of millions is refused without a pass over it
    if isinstance(value, list) and len(value) > MAX_TOKEN_LIST:
        raise invalid_params(f"'{name}' holds {len(value)} tokens (at most {MAX_TOKEN_LIST})", name)
    # in C (a set of the types, min and max), not a Python loop: the socket checks this on its event loop
    if not isinstance(value, list) or (value and set(map(type, value)) != {int}):
        raise invalid_params(f"'{name}' must be a list of token ids", name)
    if value and (min(value) < 0 or max(value) >= n_vocab):
        bad = next(t for t in value if not 0 <= t < n_vocab)
        raise invalid_params(f"'{name}' holds token id {bad} outside the vocabulary [0, {n_vocab})", name)
    return list(value)


def _spec_overrides(params: dict[str, Any]) -> dict[str, Any]:
    """Merge the nested `speculative` object and the flat `speculative.x` keys (flat wins)."""
    merged: dict[str, Any] = {}
    nested = params.get("speculative")
    if nested is not None:
        if not isinstance(nested, dict):
            raise invalid_params("'speculative' must be an object", "speculative")
        reject_unknown(nested, set(SPEC_FIELDS), "speculative")
        merged.update(nested)
    for f in SPEC_FIELDS:
        if f"speculative.{f}" in params:
            merged[f] = params[f"speculative.{f}"]
    return merged


def parse_spec(params: dict[str, Any], base: SpecParams) -> SpecParams | None:
    """Per-request speculation settings, or None to use the server's own."""
    over = _spec_overrides(params)
    if not over:
        return None
    # Field names in errors use the flat spelling, the one llama-server documents.
    named = {f"speculative.{k}": v for k, v in over.items()}
    kw: dict[str, Any] = {}
    if "n_max" in over:
        kw["n_max"] = get_int(named, "speculative.n_max", base.n_max)
    if "n_min" in over:
        kw["n_min"] = get_int(named, "speculative.n_min", base.n_min)
    if "p_min" in over:
        kw["p_min"] = get_float(named, "speculative.p_min", base.p_min)
    if "adaptive" in over:
        kw["adaptive"] = get_bool(named, "speculative.adaptive", base.adaptive)
    if "type" in over:
        value = over["type"]
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values) or len(values) > 64:
            raise invalid_params("'speculative.type' must be a string or a list of strings", "speculative.type")
        try:
            # The registry knows third-party drafters (entry points) as well as the built-in names.
            kw["types"] = parse_spec_types(values)
        except ConfigError as exc:
            raise invalid_params(f"'speculative.type': {exc}", "speculative.type") from None
    return base.with_(**kw)


def parse_sampling(params: dict[str, Any], base: SamplingParams, tokenizer: Any = None) -> SamplingParams:
    return base.with_(
        **{name: get_float(params, name, getattr(base, name)) for name in FLOAT_SAMPLING},
        **{name: get_int(params, name, getattr(base, name)) for name in INT_SAMPLING},
        logit_bias=parse_logit_bias(params, base.logit_bias, tokenizer),
        dry_sequence_breakers=parse_dry_breakers(params, base.dry_sequence_breakers),
        samplers=parse_samplers(params, base.samplers),
    )


def parse_dry_breakers(params: dict[str, Any], base: tuple[str, ...]) -> tuple[str, ...]:
    """llama-server's `dry_sequence_breakers`: a non-empty array of strings (it replaces the defaults)."""
    value = params.get("dry_sequence_breakers")
    if value is None:
        return base
    if (not isinstance(value, list) or not value or len(value) > MAX_DRY_BREAKERS
            or not all(isinstance(b, str) and len(b) <= MAX_STOP_CHARS for b in value)):
        raise invalid_params(f"'dry_sequence_breakers' must be an array of 1 to {MAX_DRY_BREAKERS} strings",
                             "dry_sequence_breakers")
    return tuple(value)


def parse_samplers(params: dict[str, Any], base: tuple[str, ...]) -> tuple[str, ...]:
    """llama-server's `samplers`: an array of sampler names or a string of one-letter codes."""
    value = params.get("samplers")
    if value is None:
        return base
    try:
        if isinstance(value, str):
            return samplers_from_chars(value)
        if isinstance(value, list) and all(isinstance(n, str) for n in value):
            return samplers_from_names(value)
    except ConfigError as exc:
        raise invalid_params(f"'samplers': {str(exc).removeprefix('samplers: ')}", "samplers") from None
    raise invalid_params("'samplers' must be an array of sampler names or a string of sampler codes", "samplers")


def parse_logit_bias(params: dict[str, Any], base: tuple[tuple[int, float], ...],
                     tokenizer: Any) -> tuple[tuple[int, float], ...]:
    from spekula.frontends.schema.logit_bias import parse

    return parse(params, base, tokenizer)


def parse_stop(params: dict[str, Any]) -> list[str]:
    value = params.get("stop", [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid_params("'stop' must be a string or a list of strings", "stop")
    if len(value) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in value):
        raise invalid_params(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                             "characters", "stop")
    return [s for s in value if s]


MAX_GRAMMAR_CHARS = 1_000_000


def parse_grammar(params: dict[str, Any]) -> GrammarSpec | None:
    """`grammar` (llama.cpp GBNF), `json_schema` (an object) or `response_format` (OpenAI's
    {"type": "json_object" | "json_schema", ...}); at most one of them."""
    given = _grammar_fields_given(params)
    if len(given) > 1:
        raise invalid_params(f"give one of {', '.join(repr(f) for f in given)}, not several", given[1])
    if not given:
        return None
    name, value = given[0], params[given[0]]
    if name == "grammar":
        if not isinstance(value, str):
            raise invalid_params("'grammar' must be a GBNF string", "grammar")
        if len(value) > MAX_GRAMMAR_CHARS:
            raise invalid_params(f"'grammar' is longer than {MAX_GRAMMAR_CHARS} characters", "grammar")
        return GrammarSpec("gbnf", value)
    if name == "json_schema":
        return _schema_spec(value, "json_schema")
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid_params("'response_format' must be an object with a string 'type'", "response_format")
    kind = value["type"]
    if kind == "json_object":
        return _schema_spec(value.get("schema", {"type": "object"}), "response_format")
    if kind == "json_schema":
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else value.get("schema")
        if schema is None:
            raise invalid_params("'response_format' of type json_schema needs json_schema.schema", "response_format")
        return _schema_spec(schema, "response_format")
    raise invalid_params(f"'response_format' type must be one of \"text\", \"json_object\" or \"json_schema\", "
                         f"got {kind[:40]!r}", "response_format")


def _schema_spec(schema: Any, name: str) -> GrammarSpec:
    if not isinstance(schema, dict | bool):
        raise invalid_params(f"'{name}': a JSON schema must be an object", name)
    text = json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise invalid_params(f"'{name}' is longer than {MAX_GRAMMAR_CHARS} characters", name)
    return GrammarSpec("json_schema", text)


def _grammar_fields_given(params: dict[str, Any]) -> list[str]:
    """The grammar fields set to something that constrains (null, "" and {"type": "text"} do not)."""
    return [f for f in GRAMMAR_FIELDS if params.get(f) not in (None, "", {"type": "text"})]


def grammar_field(params: dict[str, Any]) -> str:
    """Which request field a grammar came from (for error messages)."""
    return next(iter(_grammar_fields_given(params)), "grammar")


def check_context(prompt: list[int], n_ctx: int) -> None:
    if not prompt:
        raise invalid_params("'prompt' is empty (after tokenization)", "prompt")
    # The slot must hold the prompt and at least one generated token.
    if len(prompt) >= n_ctx:
        raise RpcError(
            CONTEXT_OVERFLOW,
            f"request ({len(prompt)} tokens) exceeds the available context size ({n_ctx} tokens), "
            "try increasing it or shortening the prompt",
            {"n_prompt_tokens": len(prompt), "n_ctx": n_ctx},
        )


def parse_completion(
    params: dict[str, Any],
    prompt: list[int],
    *,
    defaults: ServerDefaults,
    spec_base: SpecParams,
    n_ctx: int,
    n_slots: int = 1,
    tokenizer: Any = None,
) -> ParsedCompletion:
    """Everything except the prompt itself, which the caller has tokenized (see `prompt_field`);
    `tokenizer` turns logit_bias texts into tokens and bounds its ids."""
    check_context(prompt, n_ctx)
    request = CompletionRequest(
        prompt=prompt,
        n_predict=get_int(params, "n_predict", defaults.n_predict),
        sampling=parse_sampling(params, defaults.sampling, tokenizer),
        stop=parse_stop(params),
        ignore_eos=get_bool(params, "ignore_eos", False),
        spec=parse_spec(params, spec_base),
        cache_prompt=get_bool(params, "cache_prompt", True),
        id_slot=get_int(params, "id_slot", -1),
        grammar=parse_grammar(params),
        n_probs=get_int(params, "n_probs", 0),
        post_sampling_probs=get_bool(params, "post_sampling_probs", False),
        n_keep=get_int(params, "n_keep", defaults.n_keep),
        n_discard=get_int(params, "n_discard", 0),
    )
    # llama-server caps n_keep at n_ctx - 4 and clamps n_discard to what follows it; values past the
    # whole context can only be a client's mistake, so they are refused rather than quietly capped.
    for name in ("n_keep", "n_discard"):
        value = getattr(request, name)
        if value > n_ctx:
            raise invalid_params(f"'{name}' ({value}) is larger than the context of {n_ctx} tokens per slot", name)
    request.token_probs = request.n_probs > 0  # llama-server reports probabilities only when n_probs > 0
    if request.ignore_eos and request.grammar is None and tokenizer is not None:
        # A grammar's own end still ends its request, so a constrained request keeps them.
        request.sampling = banning_end_of_generation(request.sampling, getattr(tokenizer, "eog_ids", ()))
    if request.id_slot >= n_slots:
        raise invalid_params(f"'id_slot' must be -1 or a slot id in [0, {n_slots})", "id_slot")
    return ParsedCompletion(
        request=request,
        stream=get_bool(params, "stream", False),
        return_tokens=get_bool(params, "return_tokens", False),
        grammar_field=grammar_field(params),
    )


async def check_grammar(parsed: ParsedCompletion, engine: Any) -> None:
    """Compile the request's grammar now (off the event loop, cached for the engine), so that a bad
    one is the caller's -32602 / 400 naming the field, with the compiler's words for what is wrong."""
    spec = parsed.request.grammar
    if spec is None:
        return
    import anyio

    from spekula.core.modelfile.constraint import ConstraintError

    try:
        await anyio.to_thread.run_sync(engine.grammars.compile, spec)
    except ConstraintError as exc:
        name = parsed.grammar_field
        raise invalid_params(f"'{name}': invalid {'JSON schema' if spec.kind == 'json_schema' else 'grammar'}: {exc}",
                             name) from None


def prompt_field(params: dict[str, Any], n_vocab: int) -> str | list[int]:
    """The raw `prompt`: a string to tokenize, or token ids used as they are."""
    if "prompt" not in params:
        raise invalid_params("'prompt' is required", "prompt")
    value = params["prompt"]
    if isinstance(value, str):
        return value
    return get_token_list(value, "prompt", n_vocab)


def messages_field(params: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat's messages, checked as the HTTP chat endpoints check them (tool calls included)."""
    try:
        return chat_messages(params.get("messages"))
    except MessagesError as exc:
        raise invalid_params(str(exc), "messages") from None

