"""Which engine replica gets a request: the one whose slots hold the longest prefix of its prompt.

A replica's prompt cache and its ngram-mod pool only pay when related requests land on it, so the
router keeps a mirror of what every replica's slots hold (the prompt and answer of the last request
each slot finished, as the replica reported them) and sends a prompt to the replica with the longest
common prefix, when the part of it the least-loaded replica does not also hold covers more than
`min_prefix_fraction` of the prompt (the same test a replica applies to its own slots) and is at
least `min_prefix_tokens` long (every prompt shares its BOS token, and a system prompt that every
replica has cached is no reason to crowd one of them), and that replica is not far busier than the
others. Otherwise the least-loaded replica wins (fewest requests in flight; among those the longest
cached prefix, then round-robin). A session key (the OpenAI `user` field) sticks to the replica it
first went to while that replica is up.

Pure Python with no Ray in it: the Ray ingress (frontends/ray/engine.py) owns one and tells it
what started, finished and failed. The mirror is advisory: a stale entry costs a cache miss on the
replica, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ReplicaView:
    slots: dict[int, np.ndarray] = field(default_factory=dict)  # local slot -> tokens its KV holds
    in_flight: int = 0
    up: bool = True
    routed: int = 0  # requests sent here (reported in /health)
    prefix_hits: int = 0  # of which chosen for a cached prefix


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixRouter:
    def __init__(self, n_replicas: int, n_slots: int, *, min_prefix_fraction: float = 0.1,
                 min_prefix_tokens: int = 8, max_sessions: int = 65_536) -> None:
        if n_replicas < 1:
            raise ValueError("a router needs at least one replica")
        self.n_slots = n_slots
        self.min_prefix_fraction = min_prefix_fraction
        self.min_prefix_tokens = min_prefix_tokens
        self.replicas = [ReplicaView() for _ in range(n_replicas)]
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._max_sessions = max_sessions
        self._next = 0

    def choose(self, prompt: Sequence[int], *, session: str | None = None,
               exclude: frozenset[int] = frozenset()) -> int:
        """The replica for this prompt, among those not in `exclude` (a retry leaves out the one
        that failed); replicas known to be down are used only when no other is left."""
        allowed = [r for r in range(len(self.replicas)) if r not in exclude] or list(range(len(self.replicas)))
        live = [r for r in allowed if self.replicas[r].up] or allowed
        if session is not None:
            sticky = self._sessions.get(session)
            if sticky in live:
                self._sessions.move_to_end(session)
                return self._routed(sticky, hit=False)
        floor = max(1, self.min_prefix_tokens)  # shorter shared prefixes (a BOS token) count as none
        held = {r: n if (n := self._longest_prefix(prompt, r)) >= floor else 0 for r in live}
        least = self._least_loaded(live, held)
        best = max(live, key=lambda r: (held[r], -self.replicas[r].in_flight))
        # Only the part of the prefix the least-loaded replica lacks is worth moving work for: a
        # system prompt every replica has cached is no reason to crowd one of them.
        gain = held[best] - held[least]
        load_gap = self.replicas[best].in_flight - self.replicas[least].in_flight
        if best != least and gain >= floor and gain > self.min_prefix_fraction * len(prompt) and load_gap < self.n_slots:
            chosen = self._routed(best, hit=True)
        else:
            chosen = self._routed(least, hit=held[least] > 0)
        if session is not None:
            self._remember(session, chosen)
        return chosen

    def started(self, replica: int) -> None:
        self.replicas[replica].in_flight += 1

    def finished(self, replica: int, slot: int | None = None, tokens: Sequence[int] | None = None) -> None:
        """A request ended on `replica`; when it ran in a slot, that slot now holds `tokens`."""
        view = self.replicas[replica]
        view.in_flight = max(0, view.in_flight - 1)
        if slot is not None and slot >= 0 and tokens is not None:
            view.slots[slot] = np.asarray(tokens, dtype=np.int64)

    def failed(self, replica: int) -> None:
        """The replica died (or cannot be reached): its caches are gone, and it gets no new work
        until `recovered` (Ray restarts it; the ingress probes it)."""
        view = self.replicas[replica]
        view.up = False
        view.slots.clear()

    def recovered(self, replica: int) -> None:
        self.replicas[replica].up = True

    def _least_loaded(self, candidates: list[int], held: dict[int, int]) -> int:
        """Fewest requests in flight; among those the longest cached prefix, then round-robin."""
        low = min(self.replicas[r].in_flight for r in candidates)
        tied = [r for r in candidates if self.replicas[r].in_flight == low]
        longest = max(held[r] for r in tied)
        tied = [r for r in tied if held[r] == longest]
        pick = tied[self._next % len(tied)]
        self._next += 1
        return pick

    def _longest_prefix(self, prompt: Sequence[int], replica: int) -> int:
        tokens = np.asarray(prompt, dtype=np.int64)
        return max((common_prefix(tokens, held) for held in self.replicas[replica].slots.values()), default=0)

    def _routed(self, replica: int, *, hit: bool) -> int:
        view = self.replicas[replica]
        view.routed += 1
        view.prefix_hits += hit
        return replica

    def _remember(self, session: str, replica: int) -> None:
        self._sessions[session] = replica
        self._sessions.move_to_end(session)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
