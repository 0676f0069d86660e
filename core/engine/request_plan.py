"""A request resolved once: everything the scheduler needs to run it, decided before it is queued.

`plan_request` is the one place a CompletionRequest is checked and turned into settings: the
effective speculation parameters, the drafters in precedence order, their length cap, the draft
policy that sizes their drafts (core/policy/policy.py), the target's sampler, the verification rule
and its random streams. Anything wrong with the request surfaces here as a `RequestRejected`, so a
queued request can always start and a bad one ends alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spekula.core.drafting.drafter import Drafter
from spekula.core.errors import ContextOverflowError, SpekulaError
from spekula.core.modelfile.constraint import Constraint, ConstraintError, GrammarSpec
from spekula.core.modelfile.reasoning_budget import JointConstraint, ReasoningBudgetConstraint
from spekula.core.params import CompletionRequest, SpecParams
from spekula.core.policy.policy import DraftPolicy
from spekula.core.verify.dry import Breakers
from spekula.core.verify.sampling import Sampler, resolve_seed, uses_dry
from spekula.core.verify.synthetic import conditional_rates, resolve_synthetic_rates
from spekula.core.verify.verifier import Verifier, choose_verifier


class RequestRejected(SpekulaError):
    """The request cannot run; `spec_at_fault` when its own `speculative` settings are the reason."""

    def __init__(self, message: str, *, spec_at_fault: bool = False) -> None:
        super().__init__(message)
        self.spec_at_fault = spec_at_fault


@dataclass(frozen=True, slots=True)
class RequestPlan:
    spec: SpecParams
    drafters: tuple[Drafter, ...]  # precedence order: the first non-empty draft of a round wins
    n_max_eff: int  # the longest draft any of them may make (sizes per-position statistics)
    sampler: Sampler  # the target's sampler, its penalty history already fed with the prompt
    verifier: Verifier
    policy: DraftPolicy  # how long the drafts are: fixed caps or the cost model's choice
    constraint: Constraint | None = None  # grammar and reasoning budget state (masks every verification row)

    @property
    def seed(self) -> int:
        return self.sampler.seed


def drafter_cap(drafter: Drafter, spec: SpecParams) -> int:
    """A drafter's own length cap (docs/semantics.md §1.3): its declared `draft_cap`, else
    --spec-draft-n-max (the model drafters' cap)."""
    cap = getattr(drafter, "draft_cap", None)
    return cap if isinstance(cap, int) and not isinstance(cap, bool) else spec.n_max


def unshiftable_drafters(drafters: Sequence[Drafter]) -> list[str]:
    """The model drafters whose own caches cannot follow a context shift (core/engine/context_shift.py);
    draftless ones read the shifted history at their next call, so they always can."""
    return [d.name for d in drafters if d.model_based and not getattr(d, "follows_context_shift", False)]


def synthetic_rates(spec: SpecParams, drafters: Sequence[Drafter]) -> tuple[float, ...] | None:
    """Conditional synthetic acceptance rates when --spec-synth-* is on (validated against the cap)."""
    k_eff = max((drafter_cap(d, spec) for d in drafters), default=0)
    rates = resolve_synthetic_rates(k_eff, spec.synth_rates, spec.synth_len)
    return None if rates is None else conditional_rates(rates)


def check_prompt(req: CompletionRequest, n_ctx: int, n_vocab: int) -> None:
    if not req.prompt:
        raise RequestRejected("empty prompt")
    if len(req.prompt) >= n_ctx:
        raise RequestRejected(str(ContextOverflowError(
            f"the prompt has {len(req.prompt)} tokens, which does not fit the context of {n_ctx} tokens per slot")))
    if min(req.prompt) < 0 or max(req.prompt) >= n_vocab:
        raise RequestRejected(f"prompt token ids must be in [0, {n_vocab})")


def plan_request(req: CompletionRequest, *, server_spec: SpecParams, n_ctx: int, n_vocab: int,
                 drafters_for: Callable[[SpecParams], list[Drafter]],
                 is_eog: Callable[[int], bool], fixed_policy: DraftPolicy, adaptive_policy: DraftPolicy,
                 new_constraint: Callable[[GrammarSpec], Constraint] | None = None,
                 dry_breakers: Callable[[tuple[str, ...]], Breakers] | None = None,
                 context_shift: bool = False, token_piece: Callable[[int], bytes] | None = None) -> RequestPlan:
    """Check `req` and resolve it into a RequestPlan, or raise RequestRejected. `dry_breakers` turns
    DRY's sequence breakers into token sequences (with the tokenizer), for requests that use DRY. `context_shift`: the engine shifts full contexts, so
    model drafters that cannot follow a shift are refused. `token_piece`: a token's bytes, which a
    reasoning budget reads (it lets a split character finish before forcing)."""
    check_prompt(req, n_ctx, n_vocab)
    spec = req.spec or server_spec
    try:
        drafters = tuple(drafters_for(spec))
        synth = synthetic_rates(spec, drafters)
    except SpekulaError as exc:
        raise RequestRejected(str(exc), spec_at_fault=req.spec is not None) from None
    if context_shift and (unshiftable := unshiftable_drafters(drafters)):
        raise RequestRejected(f"{', '.join(unshiftable)} cannot follow a context shift, which this server does "
                              "(--context-shift)", spec_at_fault=req.spec is not None)
    try:
        breakers = None
        if dry_breakers is not None and uses_dry(req.sampling):
            breakers = dry_breakers(req.sampling.dry_sequence_breakers)
        sampler = Sampler(req.sampling, n_vocab, resolve_seed(req.sampling.seed), breakers)
    except SpekulaError as exc:
        raise RequestRejected(str(exc)) from None
    # llama-server feeds the prompt to the sampler's penalty and DRY histories before generating.
    sampler.accept_many(req.prompt)
    verifier = choose_verifier(sampler, is_eog, probabilistic=spec.draft_sampling == "probabilistic",
                               synth_rates=synth, seed=sampler.seed)
    # Synthetic acceptance measures the engine at chosen rates: the lengths stay fixed for it.
    policy = adaptive_policy if spec.adaptive and synth is None else fixed_policy
    constraint: Constraint | None = None
    if req.grammar is not None:
        if new_constraint is None:
            raise RequestRejected("this engine has no grammar support")
        try:
            constraint = new_constraint(req.grammar)
        except ConstraintError as exc:
            raise RequestRejected(f"invalid {req.grammar.kind}: {exc}") from None
    if req.reasoning_budget is not None:
        if token_piece is None:
            raise RequestRejected("this engine has no reasoning budget support")
        budget = ReasoningBudgetConstraint(req.reasoning_budget, token_piece, req.prompt)
        constraint = budget if constraint is None else JointConstraint(budget, constraint)
    return RequestPlan(spec=spec, drafters=drafters, n_max_eff=max((drafter_cap(d, spec) for d in drafters), default=0),
                       sampler=sampler, verifier=verifier, policy=policy, constraint=constraint)
