"""Llama 3.x JSON tool calls: the whole answer is the calls, JSON objects
`{"name": ..., "parameters": {...}}` (`"arguments"` is read too), optionally after
`<|python_tag|>`, several separated by `;`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An answer is calls only where it begins so (after whitespace) or where `<|python_tag|>` starts
them; any other answer, JSON that is not calls included, is content.
"""

from __future__ import annotations

import json

from infer.serve.toolcalls.base import CallPattern, Format, ToolCall, dumps

PYTHON_TAG = "<|python_tag|>"


class Llama3(Format):
    name = "llama3"
    begin, end = (PYTHON_TAG, "{"), None
    markers = (PYTHON_TAG,)

    def find_begin(self, text, at_start):
        k = text.find(PYTHON_TAG)
        if at_start and text.lstrip().startswith("{"):
            return len(text) - len(text.lstrip()), "{"
        return (k, PYTHON_TAG) if k >= 0 else None

    def held(self, text, at_start):
        keep = max((n for n in range(min(len(PYTHON_TAG) - 1, len(text)), 0, -1)
                    if text.endswith(PYTHON_TAG[:n])), default=0)
        return keep

    def block_calls(self, block, tools):
        text = block[len(PYTHON_TAG):] if block.startswith(PYTHON_TAG) else block
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(text) and (text[at].isspace() or (calls and text[at] == ";")):
                at += 1
            if at == len(text):
                return calls or None
            try:
                got, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            name = got.get("name") if isinstance(got, dict) else None
            args = got.get("parameters", got.get("arguments", {})) if isinstance(got, dict) else None
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(name, str) or not name or not isinstance(args, dict):
                return None
            calls.append(ToolCall(name, dumps(args)))

    def call_pattern(self, name, parameters):
        return CallPattern(prefix=f'{{"name": {json.dumps(name)}, "parameters": ', schema=parameters, suffix="}")


FORMAT = Llama3()
