"""Kimi K2's tool calls: a section of calls, each `functions.NAME:IDX` and its JSON arguments
between special tokens (the call's id is `functions.NAME:IDX`, as Kimi's template writes it back):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
"""

from __future__ import annotations

import re

from infer.serve.toolcalls.base import CallPattern, Format, ToolCall, dumps, json_object

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENTS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
CALL = re.compile(re.escape(CALL_BEGIN) + r"\s*([^\s<]+?)\s*" + re.escape(ARGUMENTS) + r"(.*?)" + re.escape(CALL_END),
                  re.DOTALL)
ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")


class KimiK2(Format):
    name = "kimi_k2"
    begin, end = (SECTION_BEGIN,), SECTION_END
    markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENTS, CALL_END)

    def block_calls(self, block, tools):
        inner = block[len(SECTION_BEGIN):-len(SECTION_END)]
        calls = []
        for ident, body in CALL.findall(inner):
            args = json_object(body.strip())
            if args is None:
                return None
            name = ID.fullmatch(ident).group(1)
            calls.append(ToolCall(name, dumps(args), ident))
        rest = CALL.sub("", inner)
        return calls if calls and not rest.strip() else None

    def call_pattern(self, name, parameters):
        return CallPattern(prefix=f"{SECTION_BEGIN}{CALL_BEGIN}functions.{name}:0{ARGUMENTS}", schema=parameters,
                           suffix=f"{CALL_END}{SECTION_END}")


FORMAT = KimiK2()
