"""What every tool-call format shares: a call (`ToolCall`), the pattern a constrained call follows
(`CallPattern`), the format's base (`Format`: a parse of a whole answer and a streaming parser, both
one algorithm, `BlockStream`), the reassembly of streamed deltas (`assemble`) and parameter values
typed by the tool's JSON schema (`typed`).

Most formats write each call (or a run of calls) as a block between literal markers, with
ordinary text around it: a format says which strings open a block (`begin`), which closes it
(`end`; None: the block runs to the end of the answer) and how a block's text reads as calls
(`block_calls`; None: it does not, and the block's text is content, as the model wrote it).
`BlockStream` does the rest: content flows out as it comes, held back only where it may be the
start of a marker (or is whitespace, which is dropped where it touches a call), a block is held
whole until its end and then sent as calls (or as content). `parse` runs the same stream over
the whole answer, so a stream's deltas, reassembled, are the whole answer's parse whatever the
chunking.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field


def call_id() -> str:
    """A call's id, as OpenAI spells them."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=call_id)

    def openai(self) -> dict:
        """As a message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallPattern:
    """The text of one call to one function, for constraining an answer to it: the literal
    `prefix`, then the arguments, then the literal `suffix`. The arguments are JSON matching
    `schema` (formats whose arguments are JSON: hermes, llama3, harmony, kimi_k2, deepseek_v3),
    or text matching `regex` (formats that write each parameter in markup: qwen3_coder, glm,
    minimax_m2); exactly one of the two is set. `regex()` is the whole call as one regex (the
    schema's part through outlines-core's `build_regex_from_schema`)."""

    prefix: str
    suffix: str
    schema: dict | None = None
    arguments_regex: str | None = None

    def __post_init__(self):
        if (self.schema is None) == (self.arguments_regex is None):
            raise ValueError("a CallPattern has a schema or an arguments_regex, not both or neither")

    def regex(self, whitespace: str | None = None) -> str:
        if self.arguments_regex is not None:
            body = self.arguments_regex
        else:
            from outlines_core.json_schema import build_regex_from_schema

            body = build_regex_from_schema(json.dumps(self.schema), whitespace)
        return literal(self.prefix) + body + literal(self.suffix)


def literal(text: str) -> str:
    """text as a regex that matches it alone: its metacharacters escaped, nothing else (a regex
    engine other than Python's, outlines-core's, reads it too)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text)


def content_delta(text: str) -> dict:
    return {"content": text}


def call_deltas(index: int, call: ToolCall) -> list[dict]:
    """A call as OpenAI streams it: its id, type and name (arguments ""), then its arguments."""
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


def assemble(deltas: list[dict]) -> tuple[str | None, list[ToolCall]]:
    """Streamed deltas back as (content or None, the calls): what a client does with a stream."""
    content, calls = [], {}
    for d in deltas:
        if d.get("content"):
            content.append(d["content"])
        for c in d.get("tool_calls", ()):
            entry = calls.setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = c.get("id") or entry["id"]
            fn = c.get("function", {})
            entry["name"] += fn.get("name", "")
            entry["arguments"] += fn.get("arguments", "")
    text = "".join(content)
    return text or None, [ToolCall(e["name"], e["arguments"], e["id"]) for _, e in sorted(calls.items())]


# --------------------------------------------------------------------------- typed values


def _types(schema) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, ()) or ():
            kinds += _types(sub)
    return kinds


def typed(value: str, schema) -> object:
    """A parameter written as text, as the value its schema says: "3" is 3 for an integer, "true"
    True for a boolean, JSON for an object or array; a string stays the string (and so does text
    that does not read as its type: the caller's tool sees what the model wrote)."""
    kinds = _types(schema)
    if not kinds or "string" in kinds:
        if kinds and kinds != ["string"] and value.strip() in ("null",) and "null" in kinds:
            return None
        return value
    text = value.strip()
    for kind in kinds:
        try:
            if kind == "integer" and re.fullmatch(r"-?\d+", text):
                return int(text)
            if kind == "number":
                number = float(text)
                return int(number) if re.fullmatch(r"-?\d+", text) else number
            if kind == "boolean" and text.lower() in ("true", "false"):
                return text.lower() == "true"
            if kind == "null" and text.lower() in ("null", "none"):
                return None
            if kind in ("object", "array"):
                got = json.loads(text)
                if isinstance(got, dict if kind == "object" else list):
                    return got
        except ValueError:
            continue
    return value


def properties(tools: dict | None, name: str) -> dict:
    """The properties of the tool `name`'s parameters schema ({} for an unknown tool)."""
    schema = (tools or {}).get(name) or {}
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def json_object(text: str) -> dict | None:
    """text as a JSON object, or None."""
    try:
        got = json.loads(text)
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def dumps(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


# --------------------------------------------------------------------------- formats


class Format:
    """A tool-call format. A subclass sets `name`, `begin`, `end`, `markers` (the special tokens
    its text needs kept when decoding) and implements `block_calls` and `call_pattern`."""

    name = ""
    begin: tuple[str, ...] = ()
    end: str | None = None
    markers: tuple[str, ...] = ()

    def block_calls(self, block: str, tools: dict | None) -> list[ToolCall] | None:
        """A block's calls (block: from its begin marker to its end marker, both included), or
        None where the block does not read as calls."""
        raise NotImplementedError

    def call_pattern(self, name: str, parameters: dict) -> CallPattern:
        """The text of one call of the function `name` whose arguments follow `parameters`."""
        raise NotImplementedError

    def special(self) -> tuple[str, ...]:
        """The strings the answer's text must keep where the tokenizer has them as special tokens
        (a decode that skips special tokens would drop them): the markers and the block's ends."""
        return tuple(dict.fromkeys(self.markers + self.begin + ((self.end,) if self.end else ())))

    def stream(self, tools: dict | None = None):
        """A streaming parser: `feed(text) -> deltas`, then `finish() -> deltas`."""
        return BlockStream(self, tools)

    def parse(self, text: str, tools: dict | None = None) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's (content or None, calls). tools: each tool's parameters schema by name
        (types the values of formats that write them as text)."""
        stream = self.stream(tools)
        return assemble(stream.feed(text) + stream.finish())

    # Where blocks begin. A format whose blocks begin only at the answer's start overrides both.
    def find_begin(self, text: str, at_start: bool) -> tuple[int, str] | None:
        """The first begin marker in text: (where, the marker), or None."""
        found = [(k, m) for m in self.begin if (k := text.find(m)) >= 0]
        return min(found) if found else None

    def held(self, text: str, at_start: bool) -> int:
        """How many characters at text's end may be the start of a begin marker (held back)."""
        return max((n for m in self.begin for n in range(min(len(m) - 1, len(text)), 0, -1)
                    if text.endswith(m[:n])), default=0)


class BlockStream:
    """The streaming parser of a block format (see the module's docstring). Content's trailing
    whitespace is held until more content follows; whitespace touching a call is dropped."""

    def __init__(self, fmt: Format, tools: dict | None):
        self.fmt, self.tools = fmt, tools
        self.buf = ""  # text not yet decided
        self.in_block = 0  # inside a block: its begin marker's length; 0: outside
        self.ws = ""  # whitespace held at content's end
        self.after_call = False  # the last thing out was a call (whitespace after it is dropped)
        self.at_start = True  # nothing but whitespace so far
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        self._run(out, final=False)
        return _merged(out)

    def finish(self) -> list[dict]:
        out: list[dict] = []
        self._run(out, final=True)
        if self.ws:
            out.append(content_delta(self.ws))
            self.ws = ""
        return _merged(out)

    def _content(self, text: str, out: list) -> None:
        if self.after_call:
            text = text.lstrip()
        if not text:
            return
        self.after_call = False
        whole = self.ws + text
        body = whole.rstrip()
        self.ws = whole[len(body):]
        if body:
            self.at_start = False
            out.append(content_delta(body))

    def _run(self, out: list, final: bool) -> None:
        fmt = self.fmt
        while True:
            if not self.in_block:
                hit = fmt.find_begin(self.buf, self.at_start)
                if hit is not None:
                    k, marker = hit
                    self._content(self.buf[:k], out)
                    self.buf, self.in_block = self.buf[k:], max(1, len(marker))
                    continue
                keep = 0 if final else fmt.held(self.buf, self.at_start)
                self._content(self.buf[:len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return
            j = -1 if fmt.end is None else self.buf.find(fmt.end, self.in_block)
            if j < 0 and not final:
                return
            stop = len(self.buf) if j < 0 else j + len(fmt.end)
            block, self.buf, self.in_block = self.buf[:stop], self.buf[stop:], 0
            calls = fmt.block_calls(block, self.tools) if (j >= 0 or fmt.end is None) else None
            if not calls:
                self._content(block, out)  # not calls: the text as the model wrote it
                continue
            self.ws, self.after_call, self.at_start = "", True, False
            for call in calls:
                out.extend(call_deltas(self.calls, call))
                self.calls += 1


def _merged(deltas: list[dict]) -> list[dict]:
    """Consecutive content deltas as one."""
    out: list[dict] = []
    for d in deltas:
        if "content" in d and out and "content" in out[-1]:
            out[-1] = content_delta(out[-1]["content"] + d["content"])
        else:
            out.append(d)
    return out
