"""Hermes tool calls (Qwen2.5, Qwen3, and the fallback): each call a JSON object between
`<tool_call>` and `</tool_call>` lines:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`arguments` may also be a JSON string holding the object (some fine-tunes write it so).
"""

from __future__ import annotations

import json

from infer.serve.toolcalls.base import CallPattern, Format, ToolCall, dumps, json_object

BEGIN, END = "<tool_call>", "</tool_call>"


def named_json_call(body: str, arguments_key: str = "arguments") -> ToolCall | None:
    """{"name": ..., arguments_key: {...}} as a call (its arguments a JSON object, or a string of one)."""
    got = json_object(body.strip())
    if got is None or not isinstance(got.get("name"), str) or not got["name"]:
        return None
    args = got.get(arguments_key, {})
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(got["name"], dumps(args))


class Hermes(Format):
    name = "hermes"
    begin, end = (BEGIN,), END

    def block_calls(self, block, tools):
        call = named_json_call(block[len(BEGIN):-len(END)])
        return None if call is None else [call]

    def call_pattern(self, name, parameters):
        # The arguments last, so the literal prefix holds the name: {"name": NAME, "arguments": ARGS}
        return CallPattern(prefix=f'{BEGIN}\n{{"name": {json.dumps(name)}, "arguments": ', schema=parameters,
                           suffix=f"}}\n{END}")


FORMAT = Hermes()
