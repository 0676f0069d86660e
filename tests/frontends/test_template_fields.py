"""The chat-template fields, read one way for the socket and HTTP (frontends/schema/template_fields.py)."""

from __future__ import annotations

from typing import Any

import pytest

from spekula.frontends.schema.template_fields import TemplateFieldError, read_template_fields


def test_defaults_and_accepted_forms() -> None:
    plain = read_template_fields({})
    assert (plain.add_generation_prompt, plain.continue_final, plain.tools, plain.template_kwargs) == (True, False, None, {})
    tool = {"type": "function", "function": {"name": "f"}}
    got = read_template_fields({"add_generation_prompt": False, "continue_final_message": "content",
                                "tools": [tool], "chat_template_kwargs": {"enable_thinking": False}})
    assert (got.add_generation_prompt, got.continue_final) == (False, True)
    assert got.variables() == {"enable_thinking": False, "tools": [tool]}
    assert read_template_fields({"continue_final_message": None, "add_generation_prompt": None}).add_generation_prompt


@pytest.mark.parametrize("obj,field,words", [
    ({"add_generation_prompt": 1}, "add_generation_prompt", "true or false"),
    ({"continue_final_message": "reasoning_content"}, "continue_final_message", "not supported"),
    ({"continue_final_message": "yes"}, "continue_final_message", "boolean"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", "both"),
    ({"tools": [1]}, "tools", "tool objects"),
    ({"tools": {"a": 1}}, "tools", "tool objects"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs", "add_generation_prompt"),
])
def test_bad_fields_name_themselves(obj: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(TemplateFieldError, match=words) as err:
        read_template_fields(obj)
    assert err.value.field == field
