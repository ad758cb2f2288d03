"""A request's constraint (structured output): `response_format` (json_object, json_schema), vLLM's
`structured_outputs` (json, regex, choice, json_object) and its older `guided_json`, `guided_regex`,
`guided_choice`, or a `tool_choice` that needs a call ("required", a named function: the answer is
one call in the target's tool-call format, its arguments valid against the function's schema).

`request_constraint` reads them (at most one per request, or a 400 naming the fields);
`constrained_sampling` compiles the constraint in the request's thread with the model's
`ConstraintCache` (once per constraint text, kept) and checks that the engine's pool holds it, so the
engine's thread only loads arrays. Context-free grammars (`guided_grammar`, `structured_outputs.grammar`)
are refused: the device automaton is a regular language's (a JSON schema's recursion is refused too,
`dflash_jax.constrain`)."""

from __future__ import annotations

import json

from dflash_jax.errors import InputError
from infer.serve.protocol import APIError

GRAMMAR_REFUSAL = ("context-free grammars are not supported: constraints run on the device as a regular "
                   "language's automaton (a regex, a JSON schema without recursion, a choice)")


def _response_format(value):
    from dflash_jax.constrain import Constraint

    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError(400, "response_format must be an object with a type: text, json_object or json_schema",
                       "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                           "response_format")
        if "strict" in spec and not isinstance(spec["strict"], bool):
            raise APIError(400, "response_format json_schema.strict must be a boolean", "response_format")
        return Constraint.json_schema(spec["schema"])  # strict or not, the output follows the schema
    raise APIError(400, f"response_format type must be text, json_object or json_schema, got {_short(kind)}",
                   "response_format")


def _structured_outputs(value):
    from dflash_jax.constrain import Constraint

    if not isinstance(value, dict) or not value:
        raise APIError(400, "structured_outputs must be an object with one of json, regex, choice, json_object",
                       "structured_outputs")
    known = {"json", "regex", "choice", "json_object", "grammar", "structural_tag", "disable_fallback",
             "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise APIError(400, f"structured_outputs has an unknown field '{_short(unknown[0])}'", "structured_outputs")
    if value.get("grammar") is not None or value.get("structural_tag") is not None:
        raise APIError(400, f"structured_outputs: {GRAMMAR_REFUSAL}", "structured_outputs")
    if value.get("whitespace_pattern") is not None:
        raise APIError(400, "structured_outputs.whitespace_pattern is not supported: JSON whitespace is at most "
                            "one space", "structured_outputs")
    for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
        if value.get(name) not in (None, False, True):
            raise APIError(400, f"structured_outputs.{name} must be a boolean", "structured_outputs")
    kinds = [k for k in ("json", "regex", "choice", "json_object") if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise APIError(400, "structured_outputs takes exactly one of json, regex, choice, json_object"
                            + (f" (got {', '.join(kinds)})" if kinds else ""), "structured_outputs")
    kind, body = kinds[0], value[kinds[0]]
    if kind == "json":
        return Constraint.json_schema(body)
    if kind == "regex":
        return Constraint.regex(body)
    if kind == "choice":
        return Constraint.choice(body)
    if body is not True:
        raise APIError(400, "structured_outputs.json_object must be true", "structured_outputs")
    return Constraint.json_object()


def _guided(body):
    from dflash_jax.constrain import Constraint

    if body.guided_json is not None:
        return Constraint.json_schema(body.guided_json)
    if body.guided_regex is not None:
        return Constraint.regex(body.guided_regex)
    return Constraint.choice(body.guided_choice)


def _tool_call(plan):
    """The answer as one call to the named function, or to one of the tools ("required"), in the
    target's tool-call format (its `CallPattern`s) as one regex."""
    from dflash_jax.constrain import Constraint
    from dflash_jax.constrain.constraint import WHITESPACE

    names = [plan.name] if plan.choice == "function" else list(plan.schemas)
    try:
        patterns = [plan.format.call_pattern(n, plan.schemas[n]).regex(WHITESPACE) for n in names]
    except Exception as e:  # outlines-core's schema-to-regex on a schema it cannot translate
        raise InputError(f"a tool's parameters schema cannot be constrained: {str(e).splitlines()[0]}") from None
    return Constraint.regex(patterns[0] if len(patterns) == 1 else "(" + "|".join(patterns) + ")")


def request_constraint(body, tools=None):
    """The request's one constraint as (`Constraint`, the field that asked), or None; an APIError 400
    naming the field where it is malformed, cannot be expressed, or where two fields ask at once.
    tools: the request's `ToolPlan` (its choice "required" or "function" asks for a call)."""
    asked = []
    if getattr(body, "response_format", None) is not None:
        asked.append(("response_format", lambda: _response_format(body.response_format)))
    if getattr(body, "structured_outputs", None) is not None:
        asked.append(("structured_outputs", lambda: _structured_outputs(body.structured_outputs)))
    guided = [k for k in ("guided_json", "guided_regex", "guided_choice") if getattr(body, k, None) is not None]
    if guided:
        asked.append((guided[0], lambda: _guided(body)))
    if tools is not None and tools.choice in ("required", "function"):
        asked.append(("tool_choice", lambda: _tool_call(tools)))
    fields = [name for name, _ in asked] + guided[1:]
    if len(fields) > 1:
        raise APIError(400, f"{' and '.join(fields)} each constrain the answer; a request takes one", fields[1])
    for name, make in asked:
        try:
            constraint = make()
        except InputError as e:
            raise APIError(400, f"{name}: {e}" if not str(e).startswith(name) else str(e), name) from None
        return None if constraint is None else (constraint, name)
    return None


def constrained_sampling(model, found):
    """The compiled automaton of found = (constraint, field) for this model and its engine, or an
    APIError 400 naming the field (a constraint too large for the engine's pool, or an engine that
    holds none)."""
    constraint, field = found
    if model.constraints is None:
        raise APIError(400, f"{field}: {model.constraint_refusal}", field)
    try:
        automaton = model.constraints.get(constraint)
        model.engine.check_constraint(automaton)
    except InputError as e:
        raise APIError(400, f"{field}: {e}", field) from None
    return automaton


def _short(value, limit: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
