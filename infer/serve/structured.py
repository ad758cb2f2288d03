"""A request's constraint (structured output): `response_format` (json_object, json_schema), vLLM's
`structured_outputs` (json, regex, choice, json_object) and its older `guided_json`, `guided_regex`,
`guided_choice`, or a `tool_choice` that needs a call ("required", a named function: the answer is
one call in the target's tool-call format, its arguments valid against the function's schema).

`request_constraint` reads them (`dflash_jax.constrain.fields` is the fields' one home; the tool call
is the server's): at most one per request, or a 400 naming the fields;
`constrained_sampling` compiles the constraint in the request's thread with the model's
`ConstraintCache` (once per constraint text, kept) and checks that the engine's pool holds it, so the
engine's thread only loads arrays. Context-free grammars (`guided_grammar`, `structured_outputs.grammar`)
are refused: the device automaton is a regular language's (a JSON schema's recursion is refused too,
`dflash_jax.constrain`)."""

from __future__ import annotations

from dflash_jax.errors import InputError
from infer.serve.protocol import APIError


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
    naming the field where it is malformed, cannot be expressed, or where two fields ask at once
    (`dflash_jax.constrain.fields`, the fields' one home). tools: the request's `ToolPlan` (its
    choice "required" or "function" asks for a call)."""
    from dflash_jax.constrain.fields import FIELDS, FieldError, constraint_of

    fields = {name: getattr(body, name, None) for name in FIELDS}
    try:
        found = constraint_of(fields)
        if tools is not None and tools.choice in ("required", "function"):
            if found is not None:
                raise FieldError("tool_choice", f"{found[1]} and tool_choice each constrain the answer; a request "
                                                f"takes one")
            found = (_tool_call(tools), "tool_choice")
    except FieldError as e:
        raise APIError(400, str(e), e.field) from None
    except InputError as e:
        raise APIError(400, f"tool_choice: {e}", "tool_choice") from None
    return found


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


