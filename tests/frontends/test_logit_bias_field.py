"""The `logit_bias` request field: llama-server's pair list and OpenAI's object, ids and texts, bans."""

from __future__ import annotations

import math
from typing import Any

import pytest

from spekula.frontends.schema import completion as rp
from spekula.frontends.schema.errors import ParamError


class Words:
    """A tokenizer stand-in: one token per character, id = code point."""

    n_vocab = 200

    def encode(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        assert not add_special and not parse_special  # as llama-server tokenizes bias texts
        return [ord(c) for c in text]


def parse(value: Any) -> tuple[tuple[int, float], ...]:
    return rp.parse_logit_bias({"logit_bias": value}, (), Words())


def test_every_form_gives_the_same_pairs() -> None:
    want = ((104, -100.0), (105, -100.0), (7, 2.5))
    assert parse([["hi", -100], [7, 2.5]]) == want
    assert parse({"hi": -100, "7": 2.5}) == want
    assert parse([[7, False]]) == ((7, -math.inf),)
    assert parse([[7, 1], [7, 1]]) == ((7, 1.0), (7, 1.0))  # both count, as in llama.cpp
    assert parse(None) == () and parse([]) == () and parse({}) == ()
    assert rp.parse_logit_bias({}, ((3, 1.0),), Words()) == ((3, 1.0),)  # absent: the server default


@pytest.mark.parametrize("value", [3, "x", [[1]], [[1, 2, 3]], [(1, 2)], [[1, "lots"]], [[1, True]], [[1, math.nan]],
                                   [[1, 1e9]], [[200, 1]], [[-1, 1]], {"-1": 1}, [[1.5, 1]], [[None, 1]],
                                   [["x" * 1025, 1]], [[i % 200, 1] for i in range(65_537)],
                                   [["y" * 1000, 1]] * 70])
def test_anything_else_is_an_error_naming_the_field(value: Any) -> None:
    with pytest.raises(ParamError) as err:
        parse(value)
    assert err.value.field == "logit_bias" and "logit_bias" in str(err.value)
