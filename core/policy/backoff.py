"""Backing off a model drafter whose calls do not pay, judged on what its rounds measured.

The adaptive policy asks a model drafter (a draft model, an EAGLE-3 / DFlash / DSpark / MTP head)
when the cost model predicts its draft pays. A prediction misses what the model does not see: the
engine's own work around a call and the target's next forward slowed by the head's weights in the
caches. A head that is right a little too rarely then drafts a third of the rounds at a small
predicted gain and a measured loss (SmolLM2's shipped EAGLE-3 head on held-out chat: 0.89-0.93x
plain). So each call is also judged afterwards, on measured time:

    gained  tokens its slot emitted beyond the one a plain round gives
    spent   the round's time beyond a plain round of as many generating slots (the cost model's
            plain_rounds, measured on rounds with no drafting in or before them), plus the next
            round's excess when that round drafted nothing, in plain rounds' worth of tokens

A drafter whose recent calls (decayed, per slot, leaning on the drafter's global record) spent more
than they gained rests: it is not asked again for the slot until a probe is due, REST_FIRST rounds
later, doubling up to REST_MAX while probes keep losing, and never sooner than its last call's cost
allows at PROBE_SHARE of the rounds waited; a probe that pays (or a ledger that pays again) makes it
active. While it rests and its probe is not within WAKE_AHEAD rounds, the engine
neither captures hidden states for it nor lets it observe the forwards (a drafter that can resume
after missed forwards says so: core/drafting/drafter.py), so a head that does not pay costs a call
every REST_MAX rounds and nothing in between. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A call weighs LEDGER_DECAY^age (about the last 7 calls); a ledger is judged once its calls weigh
# MIN_EVIDENCE, from the first call on: a head that pays must pay from its first call, and every call
# of one that does not costs about a round on SmolLM2 (with the prompt's catch-up, the first one
# more), so a short request cannot afford a second to find out. Judging after two calls instead left
# SmolLM2's shipped DFlash head on held-out chat at 0.94-0.95x plain where one call gave 0.99-1.0x
# (alternating runs, 2026-12-06); on the code prompts, where the heads pay, it changed nothing beyond
# the noise. A first call that loses by bad luck costs the slot REST_FIRST rounds before its probe.
LEDGER_DECAY = 0.85
MIN_EVIDENCE = 1.0
# A slot's own calls count after PRIOR_CALLS pseudo-calls of the drafter's global record.
PRIOR_CALLS = 2.0
REST_FIRST = 32
REST_MAX = 128
# A rest lasts at least the last call's measured cost (in plain rounds) over PROBE_SHARE: a head that
# does not pay must cost next to nothing (the goal: >= 0.97x plain), and a call of SmolLM2's DFlash head
# cost 0.6-1.0 rounds, so probing it every REST_FIRST rounds alone spent 2-3 %. A cheap head still
# probes every REST_FIRST rounds.
PROBE_SHARE = 0.01
# A resting drafter observes again this many forwards before its probe (EAGLE-3 drafts from the
# previous forward's last row; a few rows more give its draft layer some context back).
WAKE_AHEAD = 2
# One round's measured excess is clipped to this many plain rounds: a machine hiccup in one round
# must not decide for the next hundred.
MAX_EXCESS = 3.0


@dataclass(slots=True)
class CallLedger:
    """Decayed extra tokens gained and plain rounds' worth of tokens spent by a drafter's calls."""

    gained: float = 0.0
    spent: float = 0.0
    weight: float = 0.0

    def add(self, gained: float, spent: float) -> None:
        self.gained = LEDGER_DECAY * self.gained + gained
        self.spent = LEDGER_DECAY * self.spent + spent
        self.weight = LEDGER_DECAY * self.weight + 1.0

    def charge(self, spent: float) -> None:
        """More time of the last call, found a round later."""
        self.spent += spent

    def copy(self) -> CallLedger:
        return CallLedger(self.gained, self.spent, self.weight)


class DrafterBackoff:
    """Per (model drafter, slot): whether its calls pay, and while they do not, when it probes next."""

    def __init__(self) -> None:
        self.round = 0  # rounds planned so far (each cut of the adaptive policy is one)
        self._global: dict[str, CallLedger] = {}
        self._slot: dict[tuple[str, int], CallLedger] = {}
        self._due: dict[tuple[str, int], int] = {}  # resting -> the round its probe is due
        self._interval: dict[tuple[str, int], int] = {}  # the rest after the next losing judgement
        self._cost: dict[tuple[str, int], float] = {}  # plain rounds the last call spent, charges included

    def begin_request(self, slot: int) -> None:
        """A new request on `slot`: its own record starts over (it may be code after chat), and a
        drafter that rests keeps resting only until a first probe soon."""
        for table in (self._slot, self._interval, self._cost):
            for key in [key for key in table if key[1] == slot]:
                del table[key]
        for key in [key for key in self._due if key[1] == slot]:
            self._due[key] = min(self._due[key], self.round + REST_FIRST)

    def next_round(self) -> None:
        self.round += 1

    def may_call(self, drafter: str, slot: int) -> bool:
        """Whether `drafter` may be asked for `slot` this round: it is active, or its probe is due."""
        due = self._due.get((drafter, slot))
        if due is None:
            if self.pays(drafter, slot):
                return True
            self._judge(drafter, slot)  # a new request, and the drafter's record says it does not pay
            return False
        return self.round >= due

    def probing(self, drafter: str, slot: int) -> bool:
        """`drafter` rests for `slot` and this round is its probe."""
        due = self._due.get((drafter, slot))
        return due is not None and self.round >= due

    def resting(self, drafter: str, slot: int) -> bool:
        """`drafter` will not be asked for `slot` in the next WAKE_AHEAD rounds (its observations of
        this round's forward would be wasted)."""
        due = self._due.get((drafter, slot))
        return due is not None and self.round + WAKE_AHEAD < due

    def pays(self, drafter: str, slot: int) -> bool:
        """Whether the drafter's recent calls for the slot gained more tokens than their time cost."""
        own = self._slot.get((drafter, slot)) or CallLedger()
        glob = self._global.get(drafter) or CallLedger()
        # The other slots' calls (the global record holds this slot's too), as at most PRIOR_CALLS calls'
        # worth once the slot has calls of its own.
        others = max(glob.weight - own.weight, 0.0)
        scale = 0.0 if others <= 0 else min(1.0, PRIOR_CALLS / others) if own.weight > 0 else 1.0
        gained = own.gained + scale * max(glob.gained - own.gained, 0.0)
        spent = own.spent + scale * max(glob.spent - own.spent, 0.0)
        weight = own.weight + scale * others
        return weight < MIN_EVIDENCE or gained >= spent

    def called(self, drafter: str, slot: int, gained: float, spent: float) -> None:
        """A verified round in which `drafter` was called for `slot`: add it, and judge the drafter."""
        for ledger in (self._global.setdefault(drafter, CallLedger()),
                       self._slot.setdefault((drafter, slot), CallLedger())):
            ledger.add(gained, max(-MAX_EXCESS, min(spent, MAX_EXCESS)))
        self._cost[(drafter, slot)] = max(0.0, min(spent, MAX_EXCESS))
        self._judge(drafter, slot)

    def charge(self, drafter: str, slot: int, spent: float) -> None:
        """The round after a call of `drafter` for `slot` took `spent` more than a plain round."""
        spent = max(0.0, min(spent, MAX_EXCESS))
        for ledger in (self._global.get(drafter), self._slot.get((drafter, slot))):
            if ledger is not None:
                ledger.charge(spent)
        if (drafter, slot) in self._cost:
            self._cost[(drafter, slot)] += spent
        self._judge(drafter, slot)

    def _judge(self, drafter: str, slot: int) -> None:
        key = (drafter, slot)
        if self.pays(drafter, slot):
            self._due.pop(key, None)
            self._interval.pop(key, None)
            return
        if key in self._due and self.round < self._due[key]:
            return  # already resting (a late charge of its probe)
        interval = min(max(self._interval.get(key, REST_FIRST), math.ceil(self._cost.get(key, 0.0) / PROBE_SHARE)),
                       REST_MAX)
        self._due[key] = self.round + interval
        self._interval[key] = min(2 * interval, REST_MAX)
