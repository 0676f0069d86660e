"""suffix: the tree's counts and speculation against brute force, the drafter's memory bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ngram_helpers import arr, ctx, request

from spekula.core.drafting.drafter import Drafter
from spekula.core.errors import ConfigError
from spekula.drafters.draftless.suffix import SuffixDrafter
from spekula.drafters.draftless.suffix_tree import SuffixTree

tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=40)


def occurrences(seqs: list[list[int]], sub: list[int]) -> int:
    n = len(sub)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i : i + n] == sub)


def brute_speculate(seqs: list[list[int]], context: list[int], depth: int, max_spec: int, factor: float,
                     min_prob: float, self_count: int) -> tuple[list[int], float]:
    """The definition in the C file, spelled out over occurrence counts."""
    best: tuple[list[int], float] = ([], 0.0)
    for m in range(min(len(context), depth - 1), 0, -1):
        sub = context[len(context) - m :]
        total = occurrences(seqs, sub)
        if total == 0:
            continue
        limit = max(1, min(max_spec, int(m * factor)))
        path, p, score, first = list(sub), 1.0, 0.0, True
        out: list[int] = []
        while len(out) < limit and len(path) < depth:
            counts = {t: occurrences(seqs, path + [t]) for t in range(4)}
            t_best = max(counts, key=lambda t: (counts[t], -t))
            denom = occurrences(seqs, path) - (self_count if first else 0)
            if counts[t_best] == 0 or denom <= 0:
                break
            q = min(1.0, counts[t_best] / denom)
            if np.float32(p) * np.float32(q) < np.float32(min_prob):
                break
            p *= q
            out.append(t_best)
            score += p
            path.append(t_best)
            first = False
        if out and score > best[1] + 1e-6:
            best = (out, score)
    return best


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(tokens_st, min_size=1, max_size=4), depth=st.integers(2, 8), sub=tokens_st)
def test_counts_are_occurrences_up_to_the_depth(seqs: list[list[int]], depth: int, sub: list[int]) -> None:
    tree = SuffixTree(depth)
    for s in seqs:
        h = tree.new_sequence()
        for chunk in (s[: len(s) // 2], s[len(s) // 2 :]):  # appended in two steps, as rounds do
            tree.append(h, chunk)
    sub = sub[:10]
    expected = occurrences(seqs, sub) if 0 < len(sub) <= depth else 0
    assert tree.count(sub) == expected


@settings(max_examples=40, deadline=None)
@given(keep=st.lists(tokens_st, min_size=1, max_size=3), drop=st.lists(tokens_st, min_size=1, max_size=3),
       depth=st.integers(2, 6))
def test_removing_sequences_leaves_the_tree_of_the_others(keep: list[list[int]], drop: list[list[int]],
                                                          depth: int) -> None:
    tree, only = SuffixTree(depth), SuffixTree(depth)
    dropped = []
    for i, s in enumerate([*keep, *drop]):
        h = tree.new_sequence()
        tree.append(h, s)
        if i >= len(keep):
            dropped.append(h)
    for s in keep:
        only.append(only.new_sequence(), s)
    for h in dropped:
        tree.remove(h)
    assert tree.n_nodes == only.n_nodes
    for s in [*keep, *drop]:
        for i in range(len(s)):
            for n in range(1, depth + 1):
                assert tree.count(s[i : i + n]) == only.count(s[i : i + n])


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(tokens_st, min_size=1, max_size=3), context=st.lists(st.integers(0, 3), min_size=1, max_size=12),
       depth=st.integers(2, 7), max_spec=st.integers(1, 8), factor=st.sampled_from([0.5, 1.0, 2.0]),
       min_prob=st.sampled_from([0.0, 0.1, 0.5]), own=st.booleans())
def test_speculation_is_the_brute_force_one(seqs: list[list[int]], context: list[int], depth: int, max_spec: int,
                                            factor: float, min_prob: float, own: bool) -> None:
    if own:  # the context is one of the sequences, as in a request's own tree
        seqs = [*seqs, context]
    tree = SuffixTree(depth)
    for s in seqs:
        tree.append(tree.new_sequence(), s)
    got = tree.speculate(arr(context), max_spec, factor=factor, min_prob=min_prob, self_count=int(own))
    want, score = brute_speculate(seqs, context, depth, max_spec, factor, min_prob, int(own))
    assert got.tokens == want
    assert got.score == pytest.approx(score, rel=1e-5, abs=1e-6)
    assert all(a >= b for a, b in zip(got.probs, got.probs[1:], strict=False))


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(tokens_st, min_size=1, max_size=3), context=st.lists(st.integers(0, 3), min_size=1, max_size=12),
       depth=st.integers(2, 7), max_spec=st.integers(1, 8))
def test_speculating_after_a_held_sequence_is_speculating_on_its_tokens(seqs: list[list[int]], context: list[int],
                                                                        depth: int, max_spec: int) -> None:
    tree, holder = SuffixTree(depth), SuffixTree(depth)
    for s in seqs:
        tree.append(tree.new_sequence(), s)
    mine = tree.new_sequence()
    tree.append(mine, context[:-1])
    tree.push(mine, context[-1])
    other = holder.new_sequence()
    holder.append(other, np.asarray(context, dtype=np.int64))  # converted: the module takes int32 only
    for source, handle in ((tree, mine), (holder, other)):
        got = tree.speculate_after(source, handle, max_spec, factor=1.0, min_prob=0.1, self_count=1)
        assert got == tree.speculate(context, max_spec, factor=1.0, min_prob=0.1, self_count=1)
    assert tree.length(mine) == holder.length(other) == len(context)


def test_a_closed_tree_refuses_calls_and_bad_handles_are_errors() -> None:
    tree = SuffixTree(4)
    h = tree.new_sequence()
    tree.append(h, [1, 2, 3])
    with pytest.raises(ValueError, match="no such sequence"):
        tree.speculate_after(tree, h + 5, 4, factor=1.0, min_prob=0.1)
    with pytest.raises(ValueError, match="no such sequence"):
        tree.push(h + 5, 1)
    tree.close()
    with pytest.raises(ValueError, match="closed"):
        tree.append(h, [4])
    with pytest.raises(ConfigError, match="depth 0"):
        SuffixTree(0)


def test_drafts_the_continuation_of_a_repeated_text() -> None:
    d = SuffixDrafter()
    assert isinstance(d, Drafter)
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    prompt = [1, *text, 2, 3, *text[:3]]
    d.begin(0, arr(prompt[:-1]))
    [draft] = d.draft([request(prompt[:-1], prompt[-1])])
    # after a 3-token match, up to factor * 3 tokens of the one continuation seen
    assert draft.tokens == text[3:6]


def test_outputs_of_earlier_requests_are_drafted_from() -> None:
    d = SuffixDrafter()
    answer = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    d.begin(0, arr([1, 2]))
    d.draft([request([1, 2, *answer[:-1]], answer[-1])])  # the request's tokens so far, then it ends
    d.end(0)
    d.begin(1, arr([3, 4]))
    [draft] = d.draft([request([3, 4, *answer[:3]], answer[3], slot=1)])
    assert draft.tokens == answer[4:8]


def test_shared_tree_stays_within_its_node_budget() -> None:
    rng = np.random.default_rng(0)
    d = SuffixDrafter(max_depth=8, max_nodes=2000)
    for i in range(30):
        out = rng.integers(0, 1000, 200).astype(np.int32)
        d.begin(i % 2, arr([1]))
        d.draft([request(np.concatenate([[1], out[:-1]]), int(out[-1]), slot=i % 2)])
        d.end(i % 2)
        assert d.shared is not None and d.shared.n_nodes <= 2000 + 1
    assert 0 < len(d._outputs) < 30  # the oldest outputs were evicted


def test_caps_and_options() -> None:
    d = SuffixDrafter.create(ctx(**{"spec-suffix-n-max": 2, "spec-suffix-factor": 4.0}))
    assert d.draft_cap == 2
    text = list(range(10, 30))
    hist = [*text, 1, *text[:5]]
    d.begin(0, arr(hist))
    [draft] = d.draft([request(hist, text[5])])
    assert draft.tokens == text[6:8]
    [short] = d.draft([request(hist, text[5], n_max=1)])
    assert short.tokens == text[6:7]
    for name, value in [("spec-suffix-max-depth", 1), ("spec-suffix-factor", 0.0), ("spec-suffix-min-prob", 1.5),
                        ("spec-suffix-max-nodes", -1), ("spec-suffix-factor", "x"), ("spec-suffix-min-match", 0)]:
        with pytest.raises(ConfigError, match=name):
            SuffixDrafter.create(ctx(**{name: value}))
    with pytest.raises(ConfigError, match="spec-suffix-min-match"):  # no match that long is ever looked up
        SuffixDrafter.create(ctx(**{"spec-suffix-min-match": 8, "spec-suffix-max-depth": 8}))


def test_a_one_token_match_drafts_only_when_allowed() -> None:
    """By default a continuation needs a match of two tokens; --spec-suffix-min-match 1 drafts after one."""
    hist = [5, 6, 7, 8, 9, 1, 2, 3]  # the context [..., 3, 7] matches earlier text in its last token only
    drafts = {}
    for min_match in (None, 1):
        d = SuffixDrafter.create(ctx() if min_match is None else ctx(**{"spec-suffix-min-match": min_match}))
        d.begin(0, arr(hist))
        [one] = d.draft([request(hist, 7)])  # ... 3, 7: "7" was followed by 8
        [two] = d.draft([request([*hist, 7], 8)])  # ... 7, 8: "7 8" was followed by 9
        drafts[min_match] = (one.tokens, two.tokens)
    assert drafts[None] == ([], [9, 1])
    assert drafts[1] == ([8], [9, 1])
