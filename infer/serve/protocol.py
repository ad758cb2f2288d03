"""OpenAI's wire format as pydantic models: the completions and chat requests the server takes,
the responses and stream chunks it sends, and its error body.

A request that does not fit its model is answered 400 in OpenAI's error schema
({"error": {"message", "type", "param", "code"}}): `validation_error` turns pydantic's errors
into that answer, naming the field at fault as `param` (`messages[i]` for a chat message).
A string anywhere in a request that is not valid Unicode (a lone surrogate, "\\ud800", which JSON
can spell but UTF-8 cannot) is refused here too, before any field is read.

The models declare the fields the server implements. Any other field lands in the model's extras,
where `infer.serve.prepare` reads it against its table of fields the server knows but does not do
(`NOT_DONE`: accepted at their no-op values, refused otherwise) and refuses the rest as unknown.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic_core import PydanticCustomError

StrictInt = Annotated[int, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NonEmptyStr = Annotated[str, StringConstraints(strict=True, min_length=1)]


class APIError(Exception):
    """An error answered in OpenAI's schema: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        message, param = _printable(message), None if param is None else _printable(param)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()


def _printable(text: str) -> str:
    """text, with anything UTF-8 cannot carry (a lone surrogate) replaced: an error may quote a request."""
    return text.encode("utf-8", "replace").decode("utf-8")


# --------------------------------------------------------------------------- requests


def lone_surrogate(data: Any) -> tuple[list, str] | None:
    """The path (keys and indices) to the first string in decoded JSON, key or value, that holds a
    lone surrogate, and the surrogate as an escape ("\\ud800"); None when every string is valid
    Unicode. Iterative, so a deeply nested body costs no recursion."""
    stack = [([], data)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            if (bad := _surrogate(x)) is not None:
                return path, bad
        elif isinstance(x, dict):
            for key, value in reversed(list(x.items())):
                if isinstance(key, str) and (bad := _surrogate(key)) is not None:
                    return path, bad
                if isinstance(value, (str, dict, list)):
                    stack.append((path + [key], value))
        elif isinstance(x, list):
            stack.extend((path + [i], v) for i, v in reversed(list(enumerate(x))) if isinstance(v, (str, dict, list)))
    return None


def _surrogate(text: str) -> str | None:
    """The first lone surrogate in text as an escape, or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"\\u{ord(text[e.start]):04x}"
    return None


class _Request(BaseModel):
    """What completions and chat requests share. Fields beyond these are kept as extras (read by
    `infer.serve.prepare`: accepted at a no-op value, refused otherwise)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found is not None:
            path, escape = found
            path = [p[:40] + "..." if isinstance(p, str) and len(p) > 40 else p for p in path]
            where = _path(path) if path else "the request"
            raise PydanticCustomError("lone_surrogate", "{where} holds a lone surrogate ({escape}), which is not "
                                      "valid Unicode", {"where": where, "escape": escape, "param": _param(path)})
        return data

    model: str | None = None
    n: PositiveInt | None = Field(None, description="choices to generate, each its own row and random stream")
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = Field(None, description="0 or -1: no top-k")
    seed: StrictInt | None = Field(None, description="keys the request's random stream (modulo 2**32)")
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool | None = Field(None, description="each choice (or chunk) carries its token ids")
    # Structured output (infer.serve.structured: at most one per request; checked there, each a 400 naming it)
    response_format: Any = Field(None, description="{type: text | json_object | json_schema, json_schema: {schema}}")
    structured_outputs: Any = Field(None, description="vLLM's: {json | regex | choice | json_object: ...}")
    guided_json: dict | str | None = Field(None, description="vLLM's older name of structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM's older name of structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="vLLM's older name of structured_outputs.choice")
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100, le=100)]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit, -100..100")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None


class CompletionRequest(_Request):
    """POST /v1/completions: one prompt, as text or token ids (a batch of one is unwrapped)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    # Checked by infer.serve.prepare (0..20; null or false: none), where the message names the bound.
    logprobs: Any = Field(None, description="each token's logprob and this many top alternatives (0..20)")


class TextPart(BaseModel):
    """A part of a message's content; only text is understood."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: Annotated[str, Field(strict=True)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(strict=True)]
    content: Annotated[str, Field(strict=True)] | list[TextPart] | None = None
    name: Annotated[str, Field(strict=True)] | None = Field(None, description="passed to the chat template")
    tool_calls: list[Any] | None = Field(None, description="an assistant message's calls: [{id, type: \"function\", "
                                                           "function: {name, arguments}}]")
    tool_call_id: Any = Field(None, description="a tool message's: the id of the call it answers")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages rendered by the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="chat template variables (enable_thinking, thinking, reasoning_effort)")
    chat_template: Annotated[str, Field(strict=True)] | None = Field(
        None, description="a Jinja chat template to render the messages with; refused unless the server runs with "
                          "--trust-request-chat-template")
    # Checked by infer.serve.toolcalls.request (a 400 naming the field, in words).
    tools: Any = Field(None, description="[{type: \"function\", function: {name, description, parameters}}]")
    tool_choice: Any = Field(None, description="\"none\", \"auto\" (the default with tools), \"required\" or "
                                               "{type: \"function\", function: {name}}")
    parallel_tool_calls: Any = Field(None, description="false: an answer keeps its first call only")
    logprobs: StrictBool | None = Field(None, description="each token's logprob in choice.logprobs.content")
    top_logprobs: Any = Field(None, description="with logprobs: this many top alternatives per token (0..20)")


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()


def validation_error(errors: list[dict]) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors as a 400 in OpenAI's schema. A
    value that fits none of a field's forms (a union) is answered with the forms it may take."""
    first = errors[0] if errors else {}
    loc = _strip_body(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    if first.get("type") == "lone_surrogate":
        return APIError(400, first.get("msg", "a string is not valid Unicode"), first.get("ctx", {}).get("param"))
    if not loc or not isinstance(loc[0], str):
        return APIError(400, "the request body must be a JSON object")
    param = _param(loc)
    tag = next((i for i, part in enumerate(loc) if _union_tag(part)), None)
    if tag is None:
        return APIError(400, f"'{_path(loc)}': {first.get('msg', 'invalid')}", param)
    forms = []
    for e in errors:
        other = _strip_body(e.get("loc", ()))
        if other[:tag] == loc[:tag] and len(other) > tag and other[tag] not in forms:
            forms.append(other[tag])
    forms = [f.replace("constrained-str", "non-empty str") for f in forms]
    return APIError(400, f"'{_path(loc[:tag])}' must be one of: {', '.join(forms)}", param)


def _strip_body(loc) -> list:
    loc = list(loc)
    return loc[1:] if loc[:1] == ["body"] else loc


def _path(loc: list) -> str:
    return str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])


def _param(loc: list) -> str | None:
    """The `param` an error at loc names: the top-level field, or `messages[i]` for a chat message."""
    if not loc or not isinstance(loc[0], str):
        return None
    if loc[0] == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        return f"messages[{loc[1]}]"
    return loc[0]


def _union_tag(part) -> bool:
    """pydantic names the member of a union it tried in an error's location ("str", "list[int]")."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "constrained-str"))


def parse_request(body: Any, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """A request's JSON (already decoded) as its model; APIError (400) where it does not fit."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


# --------------------------------------------------------------------------- responses


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the server answers (4xx, 5xx, and an error event ending a stream)."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # a response's calls, or a chunk's call deltas


class Choice(BaseModel):
    """One choice of a response or a stream chunk: `text` for completions, `message` (a
    response) or `delta` (a chunk) for chat; `token_ids` with return_token_ids."""

    index: int = 0
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: dict[str, Any] | None = None  # where asked (`infer.serve.logprobs`)
    text: str | None = None
    message: AssistantMessage | None = None
    delta: AssistantMessage | None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    """A response (object "text_completion" or "chat.completion") or a stream's chunk
    ("text_completion" or "chat.completion.chunk"; the last may hold only usage)."""

    id: str
    object: Literal["text_completion", "chat.completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash-jax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict:
    """A response model as JSON-ready data: the fields it was given, no others (so a choice
    holds `text` or `message`, and `token_ids` only when asked for)."""
    return model.model_dump(exclude_unset=True)
