"""A request's or an input row's constraint fields, as OpenAI and vLLM spell them: `response_format`
(`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema": ...}}`, `{"type":
"text"}`), vLLM's `structured_outputs` (one of `json`, `regex`, `choice`, `json_object`) and its older
`guided_json`, `guided_regex`, `guided_choice`. One home for the server (`infer.serve.structured`)
and `python -m infer`'s rows. Context-free grammars are refused: the device automaton is a regular
language's."""

from __future__ import annotations

import json
from typing import Any, Mapping

from dflash_jax.constrain.constraint import Constraint
from dflash_jax.errors import InputError

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")
GRAMMAR_REFUSAL = ("context-free grammars are not supported: constraints run on the device as a regular "
                   "language's automaton (a regex, a JSON schema without recursion, a choice)")


class FieldError(InputError):
    """A constraint field that cannot be honoured; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field


def _response_format(value):
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InputError("must be an object with a type: text, json_object or json_schema")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InputError("json_schema needs json_schema.schema, a JSON schema object")
        if "strict" in spec and not isinstance(spec["strict"], bool):
            raise InputError("json_schema.strict must be a boolean")
        return Constraint.json_schema(spec["schema"])  # strict or not, the output follows the schema
    raise InputError(f"type must be text, json_object or json_schema, got {_short(kind)}")


_STRUCTURED = {"json", "regex", "choice", "json_object", "grammar", "structural_tag", "disable_fallback",
               "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}


def _structured_outputs(value):
    if not isinstance(value, dict) or not value:
        raise InputError("must be an object with one of json, regex, choice, json_object")
    unknown = sorted(set(value) - _STRUCTURED)
    if unknown:
        raise InputError(f"unknown field '{_short(unknown[0])}'")
    if value.get("grammar") is not None or value.get("structural_tag") is not None:
        raise InputError(GRAMMAR_REFUSAL)
    if value.get("whitespace_pattern") is not None:
        raise InputError("whitespace_pattern is not supported: JSON whitespace is at most one space")
    for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
        if value.get(name) not in (None, False, True):
            raise InputError(f"{name} must be a boolean")
    kinds = [k for k in ("json", "regex", "choice", "json_object") if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise InputError("takes exactly one of json, regex, choice, json_object"
                         + (f" (got {', '.join(kinds)})" if kinds else ""))
    kind, body = kinds[0], value[kinds[0]]
    if kind == "json":
        return Constraint.json_schema(body)
    if kind == "regex":
        return Constraint.regex(body)
    if kind == "choice":
        return Constraint.choice(body)
    if body is not True:
        raise InputError("json_object must be true")
    return Constraint.json_object()


_MAKERS = {"response_format": _response_format, "structured_outputs": _structured_outputs,
           "guided_json": Constraint.json_schema, "guided_regex": Constraint.regex, "guided_choice": Constraint.choice}


def constraint_of(fields: Mapping[str, Any]) -> tuple[Constraint, str] | None:
    """The one constraint these fields ask for, as (`Constraint`, the field), or None (none asked,
    or `response_format` text); a `FieldError` naming the field where one is malformed or cannot
    be expressed, or where two ask at once."""
    asked = [name for name in FIELDS if fields.get(name) is not None]
    if len(asked) > 1:
        raise FieldError(asked[1], f"{' and '.join(asked)} each constrain the answer; a request takes one")
    if not asked:
        return None
    name = asked[0]
    try:
        constraint = _MAKERS[name](fields[name])
    except InputError as e:
        raise FieldError(name, str(e)) from None
    return None if constraint is None else (constraint, name)


def _short(value, limit: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
