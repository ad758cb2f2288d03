"""The server's side of tool calls: what a target can do (`ModelTools`: its format, whether its chat
template takes tools), a request's `tools`, `tool_choice`, `parallel_tool_calls` and tool messages
checked (`plan_tools` -> `ToolPlan`; `tool_messages`), and an answer's text read as content and
calls, whole or streamed (`ToolReader`).

`tool_choice`: "none" puts the tools in the template and leaves the answer as text; "auto" (the
default with tools) reads the answer with the target's format; "required" and a named function
constrain the answer to one call (`infer.serve.structured`: the format's call pattern as a regex).
Each refusal is an `APIError`, 400 naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from infer.serve.protocol import APIError
from infer.serve.toolcalls import Format, ToolCall, assemble, format_for

MAX_TOOLS = 128  # tools per request: each is rendered into the prompt
MAX_TOOLS_CHARS = 256 * 1024  # the tools' JSON, all together
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ModelTools:
    """A target's tool calls: its `format` (`recognized`: from its template or config, not the
    hermes fallback) and whether its chat template reads `tools` at all (`takes_tools`: where it
    does not, a request's tools would vanish from the prompt, so they are refused)."""

    format: Format
    recognized: bool
    takes_tools: bool

    @classmethod
    def of(cls, model_type: str | None, chat_template) -> ModelTools:
        if isinstance(chat_template, dict):  # named templates: the default, and the tool-use one
            chat_template = "\n".join(str(t) for t in chat_template.values())
        fmt, recognized = format_for(model_type, chat_template)
        return cls(fmt, recognized, chat_template is not None and "tools" in chat_template)

    def note(self) -> str:
        """For the start-up log."""
        how = "" if self.recognized else " (the format is not recognized: the fallback)"
        return f"tool calls: {self.format.name}{how}" + ("" if self.takes_tools else "; the chat template takes no tools")


@dataclass
class ToolPlan:
    """A request's tools as checked: what goes into the template (`tools`, OpenAI's form), each
    tool's parameters schema by name, whether the answer is read for calls, and at most how many
    it keeps (`parallel_tool_calls: false`: the first only)."""

    tools: list[dict]
    schemas: dict[str, dict]
    choice: str  # "none", "auto", "required", or "function" (named: `name`)
    format: Format
    name: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def reader(self) -> ToolReader:
        return ToolReader(self)


def _tool(i: int, tool) -> dict:
    param = "tools"
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param)
    extra = set(tool) - {"type", "function"}
    if extra:
        raise APIError(400, f"{where}: unknown field '{_short(sorted(extra)[0])}'", param)
    fn = tool["function"]
    extra = set(fn) - set(FUNCTION_FIELDS)
    if extra:
        raise APIError(400, f"{where}.function: unknown field '{_short(sorted(extra)[0])}' (a function has "
                            f"{', '.join(FUNCTION_FIELDS)})", param)
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise APIError(400, f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'; got "
                            f"{_short(name)}", param)
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise APIError(400, f"{where}.function.description must be a string", param)
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise APIError(400, f"{where}.function.strict must be a boolean", param)
    parameters = fn.get("parameters")
    parameters = EMPTY_PARAMETERS if parameters is None else parameters
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise APIError(400, f"{where}.function.parameters must be a JSON schema of an object", param)
    _check_schema(parameters, f"{where}.function.parameters")
    out = {"name": name, "parameters": parameters}
    if fn.get("description") is not None:
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def _check_schema(schema: dict, where: str) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "".join(f"[{p!r}]" for p in e.path)
        raise APIError(400, f"{where} is not a valid JSON schema: {_short(e.message, 120)}"
                            + (f" (at {_short(at)})" if at else ""), "tools") from None
    except (RecursionError, ValueError, TypeError, LookupError) as e:  # a schema the checker cannot read
        raise APIError(400, f"{where} is not a valid JSON schema ({_short(str(e), 80)})", "tools") from None


def _short(value, limit: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def plan_tools(model, tools, tool_choice, parallel, template=None) -> ToolPlan | None:
    """A request's tools, tool_choice and parallel_tool_calls checked against the model
    (`model.tools`, a `ModelTools`), or the request's own chat template where it brings one (on a
    server that trusts request templates: whether it takes tools); None when it asks for no tools."""
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be a list of tools", "tools")
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: with no tools it may only be \"none\"", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools holds {len(tools)} tools; this server takes at most {MAX_TOOLS}", "tools")
    if len(json.dumps(tools)) > MAX_TOOLS_CHARS:
        raise APIError(400, f"tools is more than {MAX_TOOLS_CHARS} characters of JSON", "tools")
    checked = [_tool(i, t) for i, t in enumerate(tools)]
    schemas: dict[str, dict] = {}
    for i, t in enumerate(checked):
        name = t["function"]["name"]
        if name in schemas:
            raise APIError(400, f"tools[{i}]: the name '{name}' is another tool's too", "tools")
        schemas[name] = t["function"]["parameters"]
    choice, name = _choice(tool_choice, schemas)
    support: ModelTools = model.tools
    if isinstance(template, str):
        if "tools" not in template:
            raise APIError(400, "the request's chat_template takes no tools (they would not reach the prompt)", "tools")
    elif not support.takes_tools:
        raise APIError(400, "this model's chat template takes no tools (they would not reach the prompt)", "tools")
    # "required" and a named function constrain the answer to a call (infer.serve.structured)
    return ToolPlan(checked, schemas, choice, support.format, name, parallel is not False)


def _choice(tool_choice, schemas: dict) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and set(tool_choice) <= {
            "type", "function"} and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if not isinstance(name, str) or name not in schemas:
            raise APIError(400, f"tool_choice names the function {_short(name)}, which is not among tools",
                           "tool_choice")
        return "function", name
    raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}", "tool_choice")


# --------------------------------------------------------------------------- messages


def tool_messages(messages: list[dict], raw: list) -> None:
    """Checks the conversation's calls and answers: an assistant message's `tool_calls` (each an id,
    type "function", a name and arguments, a JSON object or its text: turned into the object, as
    templates want) and each tool message's `tool_call_id`, which answers an earlier call.
    `messages`: the template's messages, changed in place; `raw`: the request's."""
    called: dict[str, str] = {}
    for i, (out, m) in enumerate(zip(messages, raw)):
        param = f"messages[{i}]"
        calls = m.tool_calls
        if calls:
            if m.role != "assistant":
                raise APIError(400, f"{param}: only an assistant message has tool_calls", param)
            if not isinstance(calls, list):
                raise APIError(400, f"{param}: tool_calls must be a list", param)
            out["tool_calls"] = [_call(f"{param}.tool_calls[{j}]", c, called, param) for j, c in enumerate(calls)]
        if m.role == "tool":
            ident = m.tool_call_id
            if not isinstance(ident, str):
                raise APIError(400, f"{param}: a tool message needs the tool_call_id of the call it answers", param)
            if ident not in called:
                raise APIError(400, f"{param}: tool_call_id '{_short(ident)}' answers no earlier assistant "
                                    "message's tool call", param)
            out["tool_call_id"] = ident
            out.setdefault("name", called[ident])
        elif m.tool_call_id is not None:
            raise APIError(400, f"{param}: tool_call_id belongs to a tool message (role \"tool\")", param)


def _call(where: str, call, called: dict, param: str) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise APIError(400, f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                            "\"arguments\"}}}}", param)
    if call.get("type", "function") != "function":
        raise APIError(400, f"{where}.type must be \"function\"", param)
    ident, fn = call.get("id"), call["function"]
    if not isinstance(ident, str) or not ident:
        raise APIError(400, f"{where}.id must be a non-empty string", param)
    if ident in called:
        raise APIError(400, f"{where}.id '{_short(ident)}' is an earlier call's too", param)
    name, args = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where}.function.name must be a non-empty string", param)
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object (or its text)", param)
    called[ident] = name
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": args}}


# --------------------------------------------------------------------------- answers


class ToolReader:
    """One choice's answer read for calls, with the plan's format: `parse` a whole text, or `feed`
    its growing text and `finish` (streamed deltas). With parallel_tool_calls false only the first
    call is kept (the others are dropped, their text too)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.stream = plan.format.stream(plan.schemas)
        self.called = False

    def _keep(self, deltas: list[dict]) -> list[dict]:
        out = []
        for d in deltas:
            if "tool_calls" in d:
                d = {"tool_calls": [c for c in d["tool_calls"] if self.plan.parallel or c["index"] == 0]}
                if not d["tool_calls"]:
                    continue
                self.called = True
            out.append(d)
        return out

    def feed(self, text: str) -> list[dict]:
        return self._keep(self.stream.feed(text)) if text else []

    def finish(self) -> list[dict]:
        return self._keep(self.stream.finish())

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return assemble(self.feed(text) + self.finish())
