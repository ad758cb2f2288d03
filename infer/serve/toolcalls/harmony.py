"""gpt-oss's harmony format: the answer is messages, each a header (its channel, and its
recipient for a call), `<|message|>`, its text, and an end (`<|end|>`, `<|call|>`, `<|return|>`):

    <|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A message addressed `to=functions.NAME` is a call of NAME, its text the JSON arguments; a message on
the final channel (or a commentary message addressed to no one: a preamble) is content; the
analysis channel is the model's reasoning, which the answer leaves out. A message addressed to
anything else (a built-in tool this server does not run) is content, as the model wrote it.

The text format is read here, not by the `openai-harmony` package, which loads its tokenizer's
vocabulary by downloading it at run time (and the server has the model's own tokenizer).
"""

from __future__ import annotations

import re

from infer.serve.toolcalls.base import CallPattern, Format, ToolCall, assemble, call_deltas, content_delta, dumps
from infer.serve.toolcalls.base import json_object

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
ENDS = (END, CALL, RETURN, START)
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


def _held(text: str, markers) -> int:
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:n])),
               default=0)


class HarmonyStream:
    """The streaming parser of harmony's messages: a content message's text flows out as it comes
    (held back only where it may be the start of its end), a call's is held until its end."""

    def __init__(self, tools):
        self.buf, self.kind, self.name, self.calls = "", None, "", 0  # kind None: reading a header

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[dict]:
        return self._run(final=True)

    def _header(self, header: str) -> None:
        recipient = RECIPIENT.search(header)
        channel = CHANNEL_NAME.search(header)
        channel = channel.group(1) if channel else ""
        if recipient is not None and recipient.group(1).startswith("functions."):
            self.kind, self.name = "call", recipient.group(1)[len("functions."):]
        elif recipient is None and channel == "analysis":
            self.kind = "drop"
        else:
            self.kind = "content"

    def _run(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while True:
            if self.kind is None:
                k = self.buf.find(MESSAGE)
                if k < 0:
                    if final and self.buf and "<|" not in self.buf:
                        out.append(content_delta(self.buf))  # text with no message structure at all
                    if final:
                        self.buf = ""
                    return out
                self._header(self.buf[:k])
                self.buf = self.buf[k + len(MESSAGE):]
                continue
            found = [(j, m) for m in ENDS if (j := self.buf.find(m)) >= 0]
            j, end = min(found) if found else (-1, "")
            if j < 0 and not final:
                if self.kind == "content":
                    cut = len(self.buf) - _held(self.buf, ENDS)
                    if cut:
                        out.append(content_delta(self.buf[:cut]))
                        self.buf = self.buf[cut:]
                return out
            body = self.buf if j < 0 else self.buf[:j]
            self.buf = "" if j < 0 else self.buf[j + (0 if end == START else len(end)):]
            if self.kind == "call":
                args = json_object(body.strip())
                if args is None:
                    out.append(content_delta(body))
                else:
                    out.extend(call_deltas(self.calls, ToolCall(self.name, dumps(args))))
                    self.calls += 1
            elif self.kind == "content" and body:
                out.append(content_delta(body))
            self.kind = None
            if j < 0:
                return out


class Harmony(Format):
    name = "harmony"
    markers = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

    def stream(self, tools=None):
        return HarmonyStream(tools)

    def parse(self, text, tools=None):
        stream = self.stream(tools)
        return assemble(stream.feed(text) + stream.finish())

    def call_pattern(self, name, parameters):
        return CallPattern(prefix=f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}",
                           schema=parameters, suffix=CALL)


FORMAT = Harmony()
