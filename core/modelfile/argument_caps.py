"""Whether a chat template takes a tool call's arguments as an object or as JSON text, as llama.cpp tells it
(common/jinja/caps.cpp): a probe render of a call whose arguments are an object, watching whether its
value reaches the prompt. A template that takes text (Functionary v3.2's ``'>>>' + name + '\\n' +
arguments``) gets the arguments as JSON text, as llama-server hands them on when it does not convert them.

jinja2 is imported by the first probe, not by importing this module (see chat_template.py).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

_MARKER = "spekula_argument_marker_7c1e"


@lru_cache(maxsize=16)
def takes_object_arguments(source: str) -> bool:
    """Whether `source` renders an object's values when given a call's arguments as one."""
    from spekula.core.modelfile.jinja_sandbox import compile_template

    # the id in nine letters and digits, which Mistral's templates insist on
    call = {"id": "call00001", "type": "function", "function": {"name": "probe_tool", "arguments": {"arg": _MARKER}}}
    tools = [{"type": "function", "function": {"name": "probe_tool", "description": "",
                                               "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "User message"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        rendered = compile_template(source).render(messages=messages, tools=tools, add_generation_prompt=False,
                                                   bos_token="", eos_token="")
    except Exception:  # noqa: BLE001 - a template that fails on object arguments does not take them
        return False
    return _MARKER in rendered


def text_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every tool call's object arguments written as JSON text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list) and any(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                           and isinstance(c["function"].get("arguments"), dict) for c in calls):
            calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                     if isinstance(c, dict) and isinstance(c.get("function"), dict)
                     and isinstance(c["function"].get("arguments"), dict) else c for c in calls]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
