"""The draft policy behind the round (core/policy/policy.py): the fixed and adaptive policies, a cost
model that measures itself on the engine's first forwards, and a policy package below the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import anyio
from toy_backend import RepeatDrafter, ToyBackend, ToyTokenizer, make_engine, run_requests

from spekula.core.drafting.drafter import Draft
from spekula.core.params import CompletionRequest, SamplingParams, SpecParams
from spekula.core.policy.adaptive import AdaptivePolicy
from spekula.core.policy.controller import AdaptiveController
from spekula.core.policy.cost_model import CostModel
from spekula.core.policy.fixed import FixedPolicy
from spekula.core.policy.policy import DraftRound, RoundOutcome, RoundShape

POLICY_DIR = Path(__file__).parents[2] / "core" / "policy"


class _Slot:
    """A generating slot as a policy sees it (RoundSlot)."""

    def __init__(self, policy: object, slot_id: int = 0) -> None:
        self.id, self.request_id, self.n_hist, self.last = slot_id, "r1", 10, 1
        self.policy, self.constrained = policy, False

    def may_draft(self) -> bool:
        return True


def test_the_fixed_policy_asks_for_all_there_is_room_for_and_cuts_nothing() -> None:
    policy, drafter = FixedPolicy(), RepeatDrafter(4)
    shape = RoundShape(n_batch=64, base_rows=1, n_gen=1)
    assert policy.ask(_Slot(policy), drafter, False, 9, 4, shape) == 9  # the drafter stops at its own cap
    drafts = {0: (Draft([1, 2, 3]), drafter)}
    assert policy.cut(DraftRound(shape, {0: _Slot(policy)}, drafts, [], 0.0)) == {}
    outcome = RoundOutcome(4, 1, False, True, 1e-3, 0.0, 2e-3, {0: 4}, [])
    assert policy.learn(outcome) == []


def test_the_adaptive_policy_verifies_the_kept_rest_of_a_cut_draft_instead_of_asking() -> None:
    policy, drafter = AdaptivePolicy(AdaptiveController(CostModel())), RepeatDrafter(16)
    s = _Slot(policy)
    policy.tails.keep(s, drafter, [5, 6, 7, 8, 9], kept=2)  # 5, 6 verified; 7 must be the target's next token
    s.n_hist, s.last = 13, 7
    shape = RoundShape(n_batch=64, base_rows=1, n_gen=1)
    assert policy.ask(s, RepeatDrafter(16), False, 8, 16, shape) != [8, 9]  # another drafter's turn: no tail
    assert policy.ask(s, drafter, False, 8, 16, shape) == [8, 9]
    assert policy.ask(s, drafter, False, 8, 16, shape) != [8, 9]  # used up


def test_a_prior_cost_model_keeps_its_shape_until_forwards_of_each_size_measure_it() -> None:
    cost = CostModel.prior(16)
    assert sorted(cost.points) == [1, 2, 4, 8, 16] and cost.unmeasured == set(cost.points)
    guess = dict(cost.points)
    cost.observe_forward(3, 10 * cost.forward(3))  # the backend's first forward: warm-up
    assert cost.unmeasured == set(cost.points)  # it sets the level, measures no point
    assert all(abs(cost.points[n] - 10 * guess[n]) < 1e-12 for n in guess)
    cost.observe_forward(1, 2e-3)
    assert cost.forward(1) == 2e-3 and cost.unmeasured == {2, 4, 8, 16}
    assert abs(cost.points[16] / cost.points[1] - guess[16] / guess[1]) < 1e-9  # the guess's shape, measured level
    cost.observe_forward(6, 5e-3)
    assert abs(cost.forward(6) - 5e-3) < 1e-12 and cost.unmeasured == {2, 16}
    cost.observe_forward(6, 6e-3)  # measured points now follow as every cost model's do
    assert 5e-3 < cost.forward(6) < 6e-3


def test_unmeasured_points_follow_the_measured_level_without_compounding() -> None:
    """One-row forwards that grow slower round after round (a growing context) leave an unmeasured
    point at the guess's shape times the measured level, not at the product of every round's ratio."""
    cost = CostModel.prior(64)
    guess = dict(cost.points)
    cost.observe_forward(1, 5e-3)  # warm-up
    seconds = 5e-3
    for _ in range(400):
        seconds *= 1.01
        cost.observe_forward(1, seconds)
    assert 64 in cost.unmeasured
    assert abs(cost.points[64] / cost.points[1] - guess[64] / guess[1]) < 1e-9
    assert cost.points[1] < 1.2 * seconds
    f64 = cost.points[64]
    cost.observe_forward(64, 3 * f64)  # measured now: it takes what it measured
    assert 64 not in cost.unmeasured and abs(cost.forward(64) - 3 * f64) < 1e-9


def test_the_engine_times_no_forward_before_its_first_request_and_learns_from_fixed_requests() -> None:
    backend = ToyBackend()
    spec = SpecParams(types=("test-repeat",), n_max=6, adaptive=True)
    engine = make_engine(backend, ToyTokenizer(), spec=spec, drafters=[RepeatDrafter()])
    assert backend.n_forward == 0
    before = dict(engine.adaptive.cost.points)
    fixed = SpecParams(types=("test-repeat",), n_max=6, adaptive=False)
    req = CompletionRequest([7, 8, 9, 10] * 6, n_predict=12, sampling=SamplingParams(temperature=0.0))
    req.spec = fixed
    anyio.run(run_requests, engine, [req])
    assert backend.n_forward > 0
    assert engine.adaptive.cost.points != before  # the cost model follows every forward, whatever the policy
    assert engine.stats()["drafters"]["test-repeat"].get("adaptive") is None  # but decided none of them


def test_the_policy_package_does_not_import_the_engine() -> None:
    for path in POLICY_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(n.startswith("spekula.core.engine") for n in names), path.name
