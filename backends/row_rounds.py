"""A forward whose sequences add more rows than a backend takes at once, run as several forwards.

A backend with sliding-window blocks keeps only the window plus ``cap`` rows of keys per sequence (see
docs/backends.md), so one forward may add at most ``cap`` rows to a sequence. :func:`forward_in_rounds`
cuts longer inputs into consecutive pieces of ``cap`` rows, runs round k with every input's k-th piece,
and puts each input's logits and captured rows back together in its own order. A row's outputs do not
depend on its batch (the exact backends' rule), so the rounds give the bits one forward would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from spekula.backends.seq_inputs import CheckedInput
from spekula.core.backend import Capture, SeqInput, SeqOutput

Forward = Callable[[Sequence[SeqInput], Capture], list[SeqOutput]]


def needs_rounds(checked: Sequence[CheckedInput], cap: int) -> bool:
    return any(int(c.tokens.size) > cap for c in checked)


def forward_in_rounds(forward: Forward, checked: Sequence[CheckedInput], capture: Capture, cap: int,
                      n_vocab: int) -> list[SeqOutput]:
    """`forward` over `checked` in rounds of at most `cap` rows per sequence (cap >= 1)."""
    n_rounds = max((int(c.tokens.size) + cap - 1) // cap for c in checked)
    pieces: list[list[SeqOutput | None]] = [[] for _ in checked]
    for k in range(n_rounds):
        inputs, owners = [], []
        for i, c in enumerate(checked):
            a, b = k * cap, min(int(c.tokens.size), (k + 1) * cap)
            if a >= b:
                pieces[i].append(None)
                continue
            rows = c.logit_rows[(c.logit_rows >= a) & (c.logit_rows < b)] - a
            inputs.append(SeqInput(c.seq_id, c.tokens[a:b].astype(np.int32), c.start + a, rows))
            owners.append(i)
        outs = forward(inputs, capture)
        got = dict(zip(owners, outs, strict=True))
        for i in range(len(checked)):
            if i in got:
                pieces[i].append(got[i])
    return [_joined(c, [p for p in ps if p is not None], cap, n_vocab, capture) for c, ps in zip(checked, pieces,
                                                                                                   strict=True)]


def _joined(c: CheckedInput, parts: list[SeqOutput], cap: int, n_vocab: int, capture: Capture) -> SeqOutput:
    """One input's outputs of its rounds, its logits in its own logit_rows order."""
    logits = np.empty((c.logit_rows.size, n_vocab), np.float32)
    for k, part in enumerate(parts):
        a = k * cap
        sel = np.nonzero((c.logit_rows >= a) & (c.logit_rows < a + cap))[0]
        logits[sel] = part.logits  # the round's rows, in the order they appear in logit_rows
    out = SeqOutput(logits=logits)
    for layer in capture.layers:
        out.layer_inputs[layer] = np.concatenate([p.layer_inputs[layer] for p in parts])
    if capture.final_norm:
        out.hidden_final = np.concatenate([p.hidden_final for p in parts if p.hidden_final is not None])
    return out
