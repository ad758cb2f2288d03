"""GLM-4.5's tool calls (GLM-4.6, 4.7, 5): the name, then each parameter as a key and a value
element, values as text (typed by the tool's schema; the template writes a non-string value as JSON):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 may write the first key right after the name, without the newline: read too.)
"""

from __future__ import annotations

import re

from infer.serve.toolcalls.base import CallPattern, Format, literal, ToolCall, dumps, properties, typed
from infer.serve.toolcalls.hermes import BEGIN, END
from infer.serve.toolcalls.qwen3_coder import markup_regex

CALL = re.compile(r"\s*([^\s<]+)\s*((?:<arg_key>.*)?)\Z", re.DOTALL)
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


class GLM(Format):
    name = "glm"
    begin, end = (BEGIN,), END
    markers = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def block_calls(self, block, tools):
        found = CALL.match(block[len(BEGIN):-len(END)])
        if found is None:
            return None
        name, rest = found.group(1), found.group(2)
        if PAIR.sub("", rest).strip():
            return None  # not pairs alone
        props = properties(tools, name)
        args = {k.strip(): typed(v, props.get(k.strip())) for k, v in PAIR.findall(rest)}
        return [ToolCall(name, dumps(args))]

    def call_pattern(self, name, parameters):
        props = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        body = markup_regex(props, required, lambda k, v: literal(f"<arg_key>{k}</arg_key>\n<arg_value>") + v
                            + literal("</arg_value>\n"))
        return CallPattern(prefix=f"{BEGIN}{name}\n", arguments_regex=body, suffix=END)


FORMAT = GLM()
