"""A forward whose sequences add more rows than a backend takes at once, run as several forwards.

A backend with sliding-window blocks keeps only the window plus ``cap`` rows of keys per sequence (see
docs/backends.md), so one forward may add at most ``cap`` rows to a sequence; the native backend also
bounds a forward's rows in all (``total_cap``), since its scratch memory grows with them.
:func:`forward_in_rounds` cuts the inputs into consecutive pieces (:func:`plan_rounds`), runs each round,
and puts each input's logits and captured rows back together in its own order. A row's outputs do not
depend on its batch (the exact backends' rule), so the rounds give the bits one forward would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from spekula.backends.seq_inputs import CheckedInput
from spekula.core.backend import Capture, SeqInput, SeqOutput

Forward = Callable[[Sequence[SeqInput], Capture], list[SeqOutput]]


def needs_rounds(checked: Sequence[CheckedInput], cap: int, total_cap: int | None = None) -> bool:
    """Whether some input adds more than `cap` rows, or (`total_cap`) the inputs together more than that."""
    if any(int(c.tokens.size) > cap for c in checked):
        return True
    return total_cap is not None and sum(int(c.tokens.size) for c in checked) > total_cap


def plan_rounds(sizes: Sequence[int], cap: int, total_cap: int | None = None) -> list[list[tuple[int, int, int]]]:
    """Rounds of (input, first row, end row) pieces: each input's rows in order, at most `cap` of one
    input and at most `total_cap` in all per round (cap, total_cap >= 1). An input left without a piece
    in a round goes on in the next, after the inputs before it took theirs."""
    done = [0] * len(sizes)
    rounds: list[list[tuple[int, int, int]]] = []
    while any(d < n for d, n in zip(done, sizes, strict=True)):
        budget = total_cap if total_cap is not None else sum(sizes)
        pieces = []
        for i, n in enumerate(sizes):
            take = min(n - done[i], cap, budget)
            if take <= 0:
                continue
            pieces.append((i, done[i], done[i] + take))
            done[i] += take
            budget -= take
        rounds.append(pieces)
    return rounds


def forward_in_rounds(forward: Forward, checked: Sequence[CheckedInput], capture: Capture, cap: int,
                      n_vocab: int, total_cap: int | None = None) -> list[SeqOutput]:
    """`forward` over `checked` in rounds of at most `cap` rows per sequence and `total_cap` in all."""
    pieces: list[list[tuple[int, SeqOutput]]] = [[] for _ in checked]
    for round_pieces in plan_rounds([int(c.tokens.size) for c in checked], cap, total_cap):
        inputs = []
        for i, a, b in round_pieces:
            c = checked[i]
            rows = c.logit_rows[(c.logit_rows >= a) & (c.logit_rows < b)] - a
            inputs.append(SeqInput(c.seq_id, c.tokens[a:b].astype(np.int32), c.start + a, rows))
        outs = forward(inputs, capture)
        for (i, a, _), out in zip(round_pieces, outs, strict=True):
            pieces[i].append((a, out))
    return [_joined(c, ps, n_vocab, capture) for c, ps in zip(checked, pieces, strict=True)]


def _joined(c: CheckedInput, parts: list[tuple[int, SeqOutput]], n_vocab: int, capture: Capture) -> SeqOutput:
    """One input's outputs of its rounds (each with its first row), its logits in its own logit_rows order."""
    logits = np.empty((c.logit_rows.size, n_vocab), np.float32)
    ends = [a for a, _ in parts[1:]] + [int(c.tokens.size)]
    for (a, part), b in zip(parts, ends, strict=True):
        sel = np.nonzero((c.logit_rows >= a) & (c.logit_rows < b))[0]
        logits[sel] = part.logits  # the round's rows, in the order they appear in logit_rows
    outs = [part for _, part in parts]
    out = SeqOutput(logits=logits)
    for layer in capture.layers:
        out.layer_inputs[layer] = np.concatenate([p.layer_inputs[layer] for p in outs])
    if capture.final_norm:
        out.hidden_final = np.concatenate([p.hidden_final for p in outs if p.hidden_final is not None])
    return out
