"""MiniMax-M2's tool calls: invocations in a `<minimax:tool_call>` element, each parameter an
element whose text is the value (typed by the tool's schema):

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>
"""

from __future__ import annotations

import re

from infer.serve.toolcalls.base import CallPattern, Format, literal, ToolCall, dumps, properties, typed
from infer.serve.toolcalls.qwen3_coder import markup_regex

BEGIN, END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE = re.compile(r'<invoke name="?([^">]+)"?>(.*?)</invoke>', re.DOTALL)
PARAMETER = re.compile(r'<parameter name="?([^">]+)"?>(.*?)</parameter>', re.DOTALL)


def _name(text: str) -> str:
    return text.strip().strip('"')


class MiniMaxM2(Format):
    name = "minimax_m2"
    begin, end = (BEGIN,), END

    def block_calls(self, block, tools):
        inner = block[len(BEGIN):-len(END)]
        if INVOKE.sub("", inner).strip():
            return None
        calls = []
        for name, body in INVOKE.findall(inner):
            name, props = _name(name), properties(tools, _name(name))
            if PARAMETER.sub("", body).strip():
                return None
            args = {}
            for key, value in PARAMETER.findall(body):
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[_name(key)] = typed(value, props.get(_name(key)))
            calls.append(ToolCall(name, dumps(args)))
        return calls or None

    def call_pattern(self, name, parameters):
        props = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        body = markup_regex(props, required, lambda k, v: literal(f'<parameter name="{k}">') + v
                            + literal("</parameter>\n"))
        return CallPattern(prefix=f'{BEGIN}\n<invoke name="{name}">\n', arguments_regex=body,
                           suffix=f"</invoke>\n{END}")


FORMAT = MiniMaxM2()
