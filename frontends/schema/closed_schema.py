"""A tool's parameter schema as llama.cpp reads it for a call's grammar (common/json-schema.cpp): every
object schema that lists `properties` and says nothing of `additionalProperties` is closed to others, so
a constrained call carries only the parameters the tool declares (agent frameworks refuse a call with any
other). The request's own schema is not changed."""

from __future__ import annotations

from typing import Any

# Keys whose values are data or name -> schema maps, not schemas themselves.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "required"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def closed_schema(node: Any) -> Any:
    """`node` with its object schemas closed (see the module's docstring)."""
    if isinstance(node, list):
        return [closed_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYS else
           {n: closed_schema(s) for n, s in v.items()} if k in _SCHEMA_MAPS and isinstance(v, dict) else closed_schema(v)
           for k, v in node.items()}
    if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out
