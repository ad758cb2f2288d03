"""DeepSeek V3's tool calls, between special tokens, each the word `function`, the name and its
JSON arguments in a fenced block (V3, R1):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

or, from V3.1 on, the name then the bare JSON: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`.
Both are read; `call_pattern` writes V3.1's.
"""

from __future__ import annotations

import re

from infer.serve.toolcalls.base import CallPattern, Format, ToolCall, dumps, json_object

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
V3 = re.compile(r"\s*function\s*" + re.escape(SEP) + r"\s*([^\n`]+?)\s*\n```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)
V31 = re.compile(r"\s*([^\n<]+?)\s*" + re.escape(SEP) + r"\s*(.*?)\s*", re.DOTALL)


class DeepSeekV3(Format):
    name = "deepseek_v3"
    begin, end = (CALLS_BEGIN,), CALLS_END
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, SEP, CALL_END)

    def block_calls(self, block, tools):
        inner = block[len(CALLS_BEGIN):-len(CALLS_END)]
        calls = []
        for body in CALL.findall(inner):
            found = V3.fullmatch(body) or V31.fullmatch(body)
            args = json_object(found.group(2)) if found else None
            if args is None:
                return None
            calls.append(ToolCall(found.group(1), dumps(args)))
        return calls if calls and not CALL.sub("", inner).strip() else None

    def call_pattern(self, name, parameters):
        return CallPattern(prefix=f"{CALLS_BEGIN}{CALL_BEGIN}{name}{SEP}", schema=parameters,
                           suffix=f"{CALL_END}{CALLS_END}")


FORMAT = DeepSeekV3()
