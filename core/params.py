"""Request and speculation parameters, with llama.cpp's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from spekula.core.modelfile.constraint import GrammarSpec


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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

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
    # Report the target's probability of every emitted token (core/verify/token_probs.py), with its
    # n_probs most likely alternatives; after the sampler chain instead of before it if post_sampling_probs.
    token_probs: bool = False
    n_probs: int = 0
    post_sampling_probs: bool = False
    # Stream a ProgressEvent per prompt chunk (llama-server's return_progress), and the timings so far
    # with every event (timings_per_token).
    return_progress: bool = False
    timings_per_token: bool = False
