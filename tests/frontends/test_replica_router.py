"""The Ray ingress's routing and statistics merging, without Ray: which replica a prompt goes to,
and several replicas' statistics as one."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from spekula.frontends.ray.router import PrefixRouter
from spekula.frontends.ray.stats import merge_snapshots

CONVERSATION = list(range(100, 160))


def test_longest_cached_prefix_wins() -> None:
    router = PrefixRouter(3, 2)
    router.finished(2, 0, CONVERSATION[:30])
    router.finished(1, 1, CONVERSATION[:10])
    assert router.choose(CONVERSATION) == 2
    assert router.replicas[2].prefix_hits == 1


def test_a_short_or_small_shared_prefix_does_not_pull_work() -> None:
    router = PrefixRouter(2, 2, min_prefix_tokens=8)
    router.finished(0, 0, [1, *range(500, 520)])  # shares only the BOS token with the next prompt
    picks = {router.choose([1, *range(900, 920)]) for _ in range(4)}
    assert picks == {0, 1}  # round-robin among the idle replicas, not all to replica 0
    router = PrefixRouter(2, 2, min_prefix_fraction=0.5, min_prefix_tokens=1)
    router.finished(0, 0, CONVERSATION[:20])
    router.started(0)  # replica 0 is busier: its prefix must be worth the wait
    assert router.choose(CONVERSATION[:20] + list(range(1000, 1040))) == 1  # 20 of 60 tokens cached: under half
    assert router.choose(CONVERSATION[:20] + [7]) == 0 and router.replicas[0].prefix_hits == 1
    router.finished(0)
    assert router.choose(CONVERSATION[:20] + list(range(1000, 1040))) == 0  # equal load: the cache is free


def test_a_prefix_every_replica_holds_does_not_pull_work() -> None:
    router = PrefixRouter(2, 4)
    system = list(range(300, 330))  # a system prompt both replicas have cached
    router.finished(0, 0, system + [1, 2, 3])
    router.finished(1, 0, system + [4, 5, 6])
    router.finished(0, 1, system + list(range(50, 60)))
    router.started(0)
    assert router.choose(system + list(range(50, 54))) == 1  # 4 tokens more on replica 0: under 8, not worth it
    assert router.choose(system + list(range(50, 60)) + [7, 7]) == 0  # 10 more: worth one request's wait
    assert router.choose(system + [9, 9, 9, 9]) == 1  # nothing beyond the shared part: the idler one


def test_a_busy_replica_loses_its_prefix_claim_to_an_idle_one() -> None:
    router = PrefixRouter(2, 2)
    router.finished(0, 0, CONVERSATION[:40])
    for _ in range(2):
        router.started(0)
    assert router.choose(CONVERSATION) == 1  # two more in flight than replica 1: the gap is n_slots
    router.finished(0)
    assert router.choose(CONVERSATION) == 0


def test_sessions_stick_while_their_replica_is_up() -> None:
    router = PrefixRouter(2, 2)
    first = router.choose([5, 6, 7], session="alice")
    router.finished(1 - first, 0, list(range(40)))
    assert router.choose(list(range(40)), session="alice") == first  # the session beats a cached prefix
    router.failed(first)
    moved = router.choose([5, 6, 7], session="alice")
    assert moved == 1 - first
    router.recovered(first)
    assert router.choose([5, 6, 7], session="alice") == moved  # now it lives on the new one


def test_a_failed_replica_gets_no_work_and_forgets_its_cache() -> None:
    router = PrefixRouter(2, 2)
    router.finished(0, 0, CONVERSATION)
    router.failed(0)
    assert not router.replicas[0].slots
    assert {router.choose(CONVERSATION) for _ in range(5)} == {1}
    assert router.choose(CONVERSATION, exclude=frozenset({1})) == 0  # down, but the only one left
    router.recovered(0)
    assert {router.choose([9] * 20) for _ in range(4)} == {0, 1}


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 4), events=st.lists(st.tuples(st.sampled_from(["choose", "start", "end", "fail", "up"]),
                                                      st.integers(0, 3), st.lists(st.integers(0, 5), max_size=12)),
                                            max_size=40),
       exclude=st.sets(st.integers(0, 3)))
def test_choose_always_names_an_allowed_replica(n: int, events: list[tuple[str, int, list[int]]],
                                                exclude: set[int]) -> None:
    router = PrefixRouter(n, 2, min_prefix_tokens=1)
    for kind, r, tokens in events:
        r %= n
        if kind == "choose":
            got = router.choose(tokens, session=str(r), exclude=frozenset(exclude))
            allowed = set(range(n)) - exclude or set(range(n))
            assert got in allowed
        elif kind == "start":
            router.started(r)
        elif kind == "end":
            router.finished(r, r % 2, tokens)
        elif kind == "fail":
            router.failed(r)
        else:
            router.recovered(r)
        assert all(v.in_flight >= 0 for v in router.replicas)


def test_statistics_add_up_across_replicas() -> None:
    a = {"histogram": [2, 1], "acc_per_pos": [1], "n_tokens_max": 50, "n_tokens_predicted": 10,
         "t_predicted_ms": 5.0, "adaptive": None,
         "drafters": {"ngram-mod": {"calls_accept": 2, "acc_tokens": 1, "mean_acc_len": 1.5, "acc_per_pos": [1],
                                    "adaptive": {"rounds": 1, "predicted_gain": 2.0, "measured_gain": 1.0}}}}
    b = {"histogram": [0, 0, 3], "acc_per_pos": [3, 3], "n_tokens_max": 80, "n_tokens_predicted": 30,
         "t_predicted_ms": 15.0, "adaptive": None,
         "drafters": {"ngram-mod": {"calls_accept": 3, "acc_tokens": 6, "mean_acc_len": 3.0, "acc_per_pos": [3, 3],
                                    "adaptive": {"rounds": 3, "predicted_gain": 1.0, "measured_gain": 2.0}},
                      "ngram-simple": {"calls_accept": 0, "acc_tokens": 0, "mean_acc_len": 1.0, "acc_per_pos": []}}}
    m = merge_snapshots([a, b])
    assert m["histogram"] == [2, 1, 3] and m["acc_per_pos"] == [4, 3] and m["n_rounds"] == 6
    assert m["mean_acc_len"] == 1.0 + (1 + 6) / 6
    assert m["n_tokens_max"] == 80 and m["n_tokens_predicted"] == 40 and m["t_predicted_ms"] == 20.0
    mod = m["drafters"]["ngram-mod"]
    assert mod["calls_accept"] == 5 and mod["acc_tokens"] == 7 and mod["mean_acc_len"] == 1.0 + 7 / 5
    assert mod["adaptive"]["rounds"] == 4 and mod["adaptive"]["predicted_gain"] == (2.0 + 3.0) / 4
    assert set(m["drafters"]) == {"ngram-mod", "ngram-simple"} and m["adaptive"] is None


def test_the_single_machine_path_imports_no_ray() -> None:
    code = ("import sys; import spekula.frontends.cli.main, spekula.frontends.cli.cmd_serve, spekula.frontends.http.server, "
            "spekula.frontends.http.app, spekula.frontends.ray.router, spekula.frontends.ray.stats; "
            "sys.exit(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
