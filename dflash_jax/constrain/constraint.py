"""A request's constraint as text (`Constraint`, hashable: the cache's key) and its regex.

The kinds: `regex` (a pattern in Rust's `regex` syntax, which outlines-core compiles: no
look-around, no backreferences), `json_schema` (a JSON schema, kept as canonical JSON), `json_object`
(any JSON object) and `choice` (one of a list of strings, exactly).

A schema is checked twice when it is made: it must be a valid schema (jsonschema's `check_schema`),
and every keyword in it must be one outlines-core's translation to a regex enforces (or an annotation
such as `title` or `description`). A keyword it would drop silently (`minimum`, `patternProperties`,
`not`, ...) would let the output break the schema, so it is refused, naming the keyword and where.
So is a recursive `$ref` (outlines would unroll it to a fixed depth, dropping deeper branches).
"""

from __future__ import annotations

import dataclasses
import json
import re

from dflash_jax.errors import InputError

# JSON's whitespace between tokens: at most one space (output reads like json.dumps's ", " and ": ").
# A bounded pattern keeps a model from looping on whitespace; outlines-core's default is the same.
WHITESPACE = r"[ ]?"
# `json_object`: outlines-core's regex for {"type": "object"} at nesting depth 1: an object whose values
# are scalars, or objects and arrays of scalars (two levels of brackets). Its default depth, 2, makes a
# 1,623-state automaton that takes 6 s to compile on the demo's 4,096 tokens; depth 1: 399 states, 0.25 s.
JSON_OBJECT_SCHEMA = '{"type": "object", "depth": 1}'

# The keywords outlines-core's regex enforces, and the annotations that do not constrain a value.
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "allOf", "anyOf", "oneOf", "prefixItems",
    "items", "enum", "const", "$ref", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
    "minProperties", "maxProperties", "$defs", "definitions",
})
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "contentMediaType", "contentEncoding",
})
# outlines-core reads the first of these a (sub)schema has and ignores the rest.
_DISPATCH = ("properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref")
# Bounds checked before anything compiles (the compile itself is not interruptible, and runs on a
# request's thread): a constraint's text, and every repetition count (a regex's {m,n}, a schema's
# lengths and item counts), each of which can add a state per unit.
MAX_TEXT = 65536
MAX_REPEAT = 1024
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# Rust regex's meta characters (escaped in a choice).
_META = set("\\.+*?()|[]{}^$#&-~")


def escape(text: str) -> str:
    """`text` as a Rust-syntax regex that matches it literally."""
    return "".join("\\" + c if c in _META else c for c in text)


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A request's constraint, as text: `kind` ("regex" | "json_schema" | "json_object" | "choice") and
    `text` (the regex; the schema as canonical JSON; "" for json_object; the choices as a JSON list).
    Make one with the constructors, which check it."""
    kind: str
    text: str

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        if not isinstance(pattern, str):
            raise InputError(f"regex: expected a string, got {type(pattern).__name__}")
        _bounded("regex", pattern)
        counts = [int(n) for m in re.finditer(r"\{(\d+)(?:,(\d*))?\}", pattern) for n in m.groups() if n]
        if counts and max(counts) > MAX_REPEAT:
            raise InputError(f"regex: a repetition count of {max(counts)} is more than {MAX_REPEAT}")
        return cls("regex", pattern)

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InputError(f"json_schema: not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InputError(f"json_schema: a schema is a JSON object, got {type(schema).__name__}")
        _bounded("json_schema", json.dumps(schema))
        _bounded_counts(schema)
        import jsonschema

        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path)
            raise InputError(f"json_schema: invalid schema at '#/{where}': {_one_line(e.message)}") from None
        check_supported(schema)
        return cls("json_schema", json.dumps(schema))  # key order kept: properties are written in it

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object", "")

    @classmethod
    def choice(cls, choices: list[str]) -> Constraint:
        if not isinstance(choices, (list, tuple)) or not choices:
            raise InputError("choice: expected a non-empty list of strings")
        bad = [c for c in choices if not isinstance(c, str)]
        if bad:
            raise InputError(f"choice: every choice is a string, got {bad[0]!r}")
        _bounded("choice", json.dumps(list(choices)))
        return cls("choice", json.dumps(list(choices)))

    def to_regex(self) -> str:
        """The regex outlines-core compiles (Rust syntax), matched against the whole output."""
        if self.kind == "regex":
            return self.text
        if self.kind == "choice":
            return "|".join(f"({escape(c)})" for c in json.loads(self.text))
        from outlines_core.json_schema import build_regex_from_schema

        schema = self.text if self.kind == "json_schema" else JSON_OBJECT_SCHEMA
        if self.kind not in ("json_schema", "json_object"):
            raise InputError(f"constraint: unknown kind {self.kind!r}")
        try:
            return build_regex_from_schema(schema, WHITESPACE)
        except (ValueError, TypeError) as e:
            raise InputError(f"{self.kind}: not supported: {_one_line(str(e))}") from None


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _resolve(root: dict, ref: str):
    if not ref.startswith("#"):
        raise InputError(f"json_schema: $ref {ref!r} is not supported (only local references, '#/...')")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise InputError(f"json_schema: $ref {ref!r} points at nothing")
    return node


def check_supported(schema: dict) -> None:
    """Raise InputError naming the first keyword outlines-core would not enforce, a second structural
    keyword it would ignore, a required property it would not write, or a recursive `$ref`."""

    def walk(node, where: str, refs: tuple[str, ...]):
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            return
        for key in node:
            if key not in ENFORCED and key not in ANNOTATIONS:
                raise InputError(f"json_schema: keyword {key!r} at '{where}' is not supported "
                                 "(it would not be enforced on the output)")
        present = [k for k in _DISPATCH if k in node]
        if len(present) > 1:
            raise InputError(f"json_schema: {present[0]!r} and {present[1]!r} together at '{where}' are not "
                             "supported (only the first would be enforced)")
        if "properties" in node and isinstance(node.get("required"), list):
            missing = [r for r in node["required"] if r not in node["properties"]]
            if missing:
                raise InputError(f"json_schema: required property {missing[0]!r} at '{where}' is not in "
                                 "its properties (it would never be written)")
        if "$ref" in node:
            ref = node["$ref"]
            if ref in refs:
                raise InputError(f"json_schema: recursive $ref {ref!r} at '{where}' is not supported "
                                 "(a regex cannot nest without bound)")
            walk(_resolve(schema, ref), ref, refs + (ref,))
        for key in ("properties",):
            for name, sub in (node.get(key) or {}).items():
                walk(sub, f"{where}/{key}/{name}", refs)
        for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
            for i, sub in enumerate(node.get(key) or []):
                walk(sub, f"{where}/{key}/{i}", refs)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{where}/{key}", refs)

    walk(schema, "#", ())


def _bounded(kind: str, text: str) -> None:
    if len(text) > MAX_TEXT:
        raise InputError(f"{kind}: {len(text)} characters is more than {MAX_TEXT}")


def _bounded_counts(node, path: str = "#") -> None:
    """Every length and item count of a schema within MAX_REPEAT (each unit can add a state)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _COUNTS and isinstance(value, int) and not isinstance(value, bool) and value > MAX_REPEAT:
                raise InputError(f"json_schema: {key} {value} at '{path}' is more than {MAX_REPEAT}")
            _bounded_counts(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _bounded_counts(value, f"{path}/{i}")
