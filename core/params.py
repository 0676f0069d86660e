"""Request and speculation parameters, with llama.cpp's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from spekula.core.modelfile.constraint import GrammarSpec
from spekula.core.modelfile.reasoning_budget import ReasoningBudget

# llama.cpp's default `samplers` chain, in its order (logit bias always runs first, the draw last).
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")

@dataclass(frozen=True, slots=True)
class SamplingParams:
    """llama-server defaults. temperature <= 0 is greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    # OpenAI's penalties, over the same window: a token seen c times in it loses
    # c * frequency_penalty + presence_penalty from its logit (after the repeat penalty).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1: random, resolved once per request
    min_keep: int = 0  # top-p and min-p keep at least this many candidates (0: only their own cut)
    # (token id, bias) pairs added to the target's logits before anything else, in order (a token
    # named twice gets both); -inf bans the token (llama-server's `false`).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # DRY: a token that would extend a repetition of more than dry_allowed_length tokens (within the
    # last dry_penalty_last_n) loses dry_multiplier * dry_base^(length - allowed) from its logit;
    # a sequence breaker ends the repetition it is in. 0 multiplier: off.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    # XTC: with probability xtc_probability, remove every token above xtc_threshold but the least
    # likely of them (> 0.5 or probability 0: off).
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    typical_p: float = 1.0  # locally typical sampling (1: off)
    top_n_sigma: float = -1.0  # keep logits within n standard deviations of the best (<= 0: off)
    # dynamic temperature: the temperature moves within [temp - range, temp + range] with the entropy
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    # Mirostat 1 or 2 replaces the whole chain by temperature then Mirostat (0: off)
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS  # the chain's stages in order (llama.cpp's names)

    @property
    def greedy(self) -> bool:
        """No random draw: temperature <= 0 on a chain that has its temperature stage (and no dynamic
        range, which can raise it above 0); Mirostat's chain always applies the temperature."""
        if self.mirostat:
            return self.temperature <= 0.0
        return self.temperature <= 0.0 and self.dynatemp_range <= 0.0 and "temperature" in self.samplers

    def with_(self, **kw: Any) -> SamplingParams:
        return replace(self, **kw)


@dataclass(frozen=True, slots=True)
class SpecParams:
    """Speculation settings. Server-wide defaults; n_max/n_min/p_min/types may be overridden per request."""

    types: tuple[str, ...] = ()  # normalised: deduplicated, priority order, no "none"
    n_max: int = 3  # --spec-draft-n-max (draft models only)
    n_min: int = 0  # --spec-draft-n-min
    p_min: float = 0.0  # --spec-draft-p-min
    draft_sampling: Literal["greedy", "probabilistic"] = "greedy"
    synth_rates: tuple[float, ...] | None = None
    synth_len: float | None = None
    # --spec-adaptive: draft lengths chosen each round by the engine's cost model (0..the caps
    # above); off drafts as far as the caps allow, exactly as llama.cpp does.
    adaptive: bool = True
    # Per-drafter options by llama.cpp's option name without the leading dashes,
    # e.g. {"spec-ngram-simple-size-n": 12}. Drafters read their own with defaults.
    drafter_options: dict[str, Any] = field(default_factory=dict)

    def with_(self, **kw: Any) -> SpecParams:
        return replace(self, **kw)


@dataclass(slots=True)
class CompletionRequest:
    """One generation request (llama-server /completion semantics)."""

    prompt: list[int]  # token ids, already tokenized (BOS included if the model wants it)
    n_predict: int = -1  # -1: until EOS / stop / context full
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Per-request speculation overrides ("speculative.n_max", ...); None = server-wide SpecParams.
    spec: SpecParams | None = None
    id: str = ""  # assigned by the engine when empty
    # Reuse the longest prefix of this prompt that a slot's KV already holds (llama-server's default).
    cache_prompt: bool = True
    id_slot: int = -1  # run in this slot (waiting for it if busy); -1: the engine chooses
    grammar: GrammarSpec | None = None  # constrained decoding: GBNF, a JSON schema, ...
    # A positive reasoning budget: its message and end forced after N reasoning tokens (a constraint too)
    reasoning_budget: ReasoningBudget | None = None
    # Report the target's probability of every emitted token (core/verify/token_probs.py), with its
    # n_probs most likely alternatives; after the sampler chain instead of before it if post_sampling_probs.
    token_probs: bool = False
    n_probs: int = 0
    post_sampling_probs: bool = False
    # Stream a ProgressEvent per prompt chunk (llama-server's return_progress), and the timings so far
    # with every event (timings_per_token).
    return_progress: bool = False
    timings_per_token: bool = False
    # Context shift (an engine with context_shift on; core/engine/context_shift.py): the first n_keep
    # tokens (-1: the whole prompt) stay when a full context drops n_discard (0: half the rest) after them.
    n_keep: int = 0
    n_discard: int = 0
