"""Qwen3-Coder's tool calls (also Qwen3.5's): a call's parameters as markup, one element each, their
values as text (typed by the tool's schema: "3" is 3 for an integer parameter):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
"""

from __future__ import annotations

import json
import re

from infer.serve.toolcalls.base import CallPattern, Format, literal, ToolCall, dumps, properties, typed
from infer.serve.toolcalls.hermes import BEGIN, END

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _value(text: str) -> str:
    """A value as the template writes it: between a newline after the tag and one before the close."""
    return text[1:] if text.startswith("\n") else text


def markup_regex(props: dict, required, element) -> str:
    """A regex of a call's parameters as markup, in the schema's order (the required ones always,
    the others optional): `element(name, value_regex)` writes one."""
    parts = []
    for key, schema in props.items():
        one = element(key, value_regex(schema))
        parts.append(one if key in required else f"(?:{one})?")
    return "".join(parts)


def value_regex(schema) -> str:
    """A parameter's value written as text: a JSON scalar of its type, JSON for an object or array,
    text without '<' for a string (or anything else)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "integer":
        return r"-?(?:0|[1-9][0-9]*)"
    if kind == "number":
        return r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
    if kind == "boolean":
        return r"(?:true|false)"
    if kind in ("object", "array"):
        from outlines_core.json_schema import build_regex_from_schema

        return build_regex_from_schema(json.dumps(schema))
    return r"[^<]*"


class Qwen3Coder(Format):
    name = "qwen3_coder"
    begin, end = (BEGIN,), END

    def block_calls(self, block, tools):
        found = FUNCTION.match(block[len(BEGIN):-len(END)])
        if found is None:
            return None
        name = found.group(1).strip()
        props = properties(tools, name)
        args = {}
        for key, value in PARAMETER.findall(found.group(2)):
            key = key.strip()
            value = _value(value)
            value = value[:-1] if value.endswith("\n") else value
            args[key] = typed(value, props.get(key))
        return [ToolCall(name, dumps(args))]

    def call_pattern(self, name, parameters):
        props = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        body = markup_regex(props, required, lambda k, v: literal(f"<parameter={k}>\n") + v
                            + literal("\n</parameter>\n"))
        return CallPattern(prefix=f"{BEGIN}\n<function={name}>\n", arguments_regex=body,
                           suffix=f"</function>\n{END}")


FORMAT = Qwen3Coder()
