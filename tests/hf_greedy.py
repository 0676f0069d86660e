"""transformers' own incremental decoding: the greedy reference the backend tests compare with.

A hand loop rather than ``generate``: ``generate`` would stop at EOS or, with ``min_new_tokens``, mask
EOS out, and either changes the continuation being compared.
"""

from __future__ import annotations

from typing import Any


def hf_greedy(model: Any, ids: list[int], n_new: int) -> list[int]:
    """`n_new` tokens after `ids`, argmax every step, from `model`'s forward with its KV cache."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        gen = [int(out.logits[0, -1].argmax())]
        for _ in range(n_new - 1):
            out = model(torch.tensor([gen[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            gen.append(int(out.logits[0, -1].argmax()))
    return gen
