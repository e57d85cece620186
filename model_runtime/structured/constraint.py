"""What a constrained request asks for, and the checks that bound it (pure Python).

A ``Constraint`` rides in ``SamplingParams`` from the front end to every worker that samples
for the request. The API layer turns OpenAI's ``response_format``, ``tools`` / ``tool_choice``
and the vLLM-style extras (regex, choice, grammar) into one; the workers compile it
(``structured.compiler``) and mask each sampled row by it (``structured.matchers``).

``check_constraint`` runs before anything is compiled, at the router and again on every worker
(a worker trusts no other process). It refuses, naming the feature:

- specs larger than the caps below (a client controls their size);
- JSON schemas nested deeper than ``MAX_SCHEMA_DEPTH`` or with more than ``MAX_SCHEMA_NODES``
  sub-schemas, and any keyword the grammar engine does not enforce (``SCHEMA_KEYWORDS``): an
  ignored keyword would let through output the client's validator rejects, with a 200;
- ``$ref`` outside the document (no fetching), choice lists that are empty, too long or hold
  duplicates or empty strings.

What only compiling can tell (a regex that matches nothing, a compile that runs too long, a
grammar that does not parse) is the compiler's to refuse.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.model_runtime.errors import InvalidRequestError

MAX_SPEC_BYTES = 64 * 1024  # a schema, grammar or choice list as sent
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 32  # nested sub-schemas
MAX_SCHEMA_NODES = 4096
MAX_ENUM_VALUES = 4096


class ConstraintKind(enum.Enum):
    """``JSON_OBJECT``: any JSON object (``spec`` empty); ``JSON_SCHEMA``: a JSON Schema (``spec``
    its JSON text); ``REGEX``: a regular expression the whole output matches; ``CHOICE``: one of
    the strings in ``spec``, a JSON list; ``GRAMMAR``: an EBNF grammar (GBNF dialect, rule
    ``root``)."""

    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class Constraint:
    """The language a request's output must belong to. Equal constraints share one compiled
    grammar on a worker (``key``)."""

    kind: ConstraintKind
    spec: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind.value, self.spec)

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool) -> Constraint:
        """A schema in compact form, so equal schemas share a key. Keys keep the client's
        order: the output's properties follow it (a "reasoning" field before an "answer"
        field is the point of writing it first)."""
        return Constraint(ConstraintKind.JSON_SCHEMA, canonical_json(schema, "json_schema"))

    @staticmethod
    def choice(options: list[str]) -> Constraint:
        return Constraint(ConstraintKind.CHOICE, canonical_json(options, "choice"))

    def describe(self) -> str:
        """A short, log-safe name (never the spec itself)."""
        return f"{self.kind.value} ({len(self.spec)} bytes)"


def canonical_json(value: Any, name: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidRequestError(name, f"is not JSON-encodable: {e}") from None


# Keywords whose constraint the grammar engine enforces (``tests/unit/test_structured_keywords.py``
# proves each with a document that violates it), and annotations that constrain nothing.
SCHEMA_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
        "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
        "exclusiveMaximum", "format",
    }
)  # fmt: skip
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
     "readOnly", "writeOnly", "discriminator", "strict"}
)  # fmt: skip
FORMATS = frozenset({"date", "time", "date-time", "email", "uuid", "ipv4", "ipv6", "uri", "hostname"})
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# A keyword with a value that constrains nothing is accepted: pydantic writes some of these.
_NEUTRAL = {"uniqueItems": False, "additionalItems": True, "minProperties": 0}


def check_constraint(c: Constraint) -> None:
    """Raise ``InvalidRequestError`` for a constraint no worker will compile (see the module
    docstring). Field names are the API's: ``response_format``, ``regex``, ``choice``,
    ``grammar``."""
    field = field_of(c)
    if len(c.spec.encode()) > MAX_SPEC_BYTES:
        raise InvalidRequestError(field, f"is {len(c.spec.encode())} bytes; the cap is {MAX_SPEC_BYTES}")
    if c.kind is ConstraintKind.JSON_OBJECT:
        if c.spec:
            raise InvalidRequestError(field, "json_object takes no schema")
    elif c.kind is ConstraintKind.JSON_SCHEMA:
        check_schema(_loads(c.spec, field), field)
    elif c.kind is ConstraintKind.REGEX:
        if not c.spec:
            raise InvalidRequestError(field, "must not be empty")
        if len(c.spec) > MAX_REGEX_CHARS:
            raise InvalidRequestError(field, f"is {len(c.spec)} characters; the cap is {MAX_REGEX_CHARS}")
    elif c.kind is ConstraintKind.CHOICE:
        options = _loads(c.spec, field)
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise InvalidRequestError(field, "must be a non-empty list of strings")
        if len(options) > MAX_CHOICES:
            raise InvalidRequestError(field, f"has {len(options)} options; the cap is {MAX_CHOICES}")
        if "" in options or len(set(options)) != len(options):
            raise InvalidRequestError(field, "options must be distinct, non-empty strings")
    elif not c.spec.strip():
        raise InvalidRequestError(field, "must not be empty")


_FIELD = {
    ConstraintKind.JSON_OBJECT: "response_format",
    ConstraintKind.JSON_SCHEMA: "response_format",
    ConstraintKind.REGEX: "regex",
    ConstraintKind.CHOICE: "choice",
    ConstraintKind.GRAMMAR: "grammar",
}


def field_of(c: Constraint) -> str:
    """The field a refusal of ``c`` names (the API's)."""
    return _FIELD[c.kind]


def _loads(spec: str, field: str) -> Any:
    try:
        return json.loads(spec)
    except (ValueError, RecursionError) as e:
        raise InvalidRequestError(field, f"is not valid JSON: {e}") from None


def check_schema(schema: Any, field: str = "response_format") -> None:
    """A JSON Schema every keyword of which is enforced (``SCHEMA_KEYWORDS``), within the caps."""
    if isinstance(schema, bool):
        if not schema:
            raise InvalidRequestError(field, "the schema `false` matches nothing")
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(field, "a JSON schema must be an object")
    for nodes, (path, node, depth) in enumerate(_subschemas(schema, "#", 0), 1):
        if nodes > MAX_SCHEMA_NODES:
            raise InvalidRequestError(field, f"the schema has more than {MAX_SCHEMA_NODES} sub-schemas")
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(
                field, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels at {path}"
            )
        _check_node(node, path, field)


def _check_node(node: dict[str, Any], path: str, field: str) -> None:
    for key, value in node.items():
        if key in ANNOTATIONS or (key in _NEUTRAL and value == _NEUTRAL[key]):
            continue
        if key not in SCHEMA_KEYWORDS:
            raise InvalidRequestError(
                field, f"unsupported JSON Schema feature {key!r} at {path} (it would not be enforced)"
            )
    types = node.get("type")
    for t in types if isinstance(types, list) else [types] if types is not None else []:
        if t not in TYPES:
            raise InvalidRequestError(field, f"unknown type {t!r} at {path}")
    ref = node.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
        raise InvalidRequestError(field, f"only local $ref ('#/...') is supported, got {ref!r} at {path}")
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise InvalidRequestError(field, f"unsupported string format {fmt!r} at {path}")
    enum_values = node.get("enum")
    if enum_values is not None:
        if not isinstance(enum_values, list) or not enum_values:
            raise InvalidRequestError(field, f"enum must be a non-empty list at {path}")
        if len(enum_values) > MAX_ENUM_VALUES:
            raise InvalidRequestError(
                field, f"enum has {len(enum_values)} values at {path}; the cap is {MAX_ENUM_VALUES}"
            )
    if isinstance(node.get("items"), list):
        raise InvalidRequestError(field, f"tuple-form items at {path}: use prefixItems")
    _check_combination(node, path, field)
    for bound in ("minItems", "maxItems", "minLength", "maxLength"):
        value = node.get(bound)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise InvalidRequestError(field, f"{bound} must be a non-negative integer at {path}")


# The engine reads these keywords alone: a constraint beside one of them is dropped.
_ALONE = ("$ref", "anyOf", "enum", "const")
_STRING_ONLY = ("minLength", "maxLength", "pattern", "format")
_NUMBER_ONLY = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_JSON_TYPES = {str: "string", bool: "boolean", type(None): "null", list: "array", dict: "object"}


def _json_type(value: Any) -> set[str]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return {_JSON_TYPES.get(type(value), "")}
    return {"number", "integer"} if isinstance(value, int) or value.is_integer() else {"number"}


def _check_combination(node: dict[str, Any], path: str, field: str) -> None:
    """Refuse keyword combinations the engine compiles without enforcing all of them."""
    types = node.get("type")
    declared = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else set()
    constraining = {
        k for k, v in node.items()
        if k not in ANNOTATIONS and k not in ("$defs", "definitions") and _NEUTRAL.get(k, object()) != v
    }  # fmt: skip
    for key in _ALONE:
        if key not in node:
            continue
        others = constraining - {key}
        if key in ("enum", "const") and "type" in others:
            values = node[key] if key == "enum" else [node[key]]
            if all(_json_type(v) & declared for v in values):
                others.discard("type")  # every value has the type: it constrains nothing more
        if others:
            raise InvalidRequestError(
                field, f"{', '.join(sorted(others))} beside {key!r} at {path} (it would not be enforced)"
            )
    string_kw = [k for k in _STRING_ONLY if k in node]
    if string_kw and "string" not in declared:
        raise InvalidRequestError(field, f'{string_kw[0]} at {path} needs "type": "string"')
    number_kw = [k for k in _NUMBER_ONLY if k in node]
    if number_kw and not declared & {"number", "integer"}:
        raise InvalidRequestError(field, f'{number_kw[0]} at {path} needs a numeric "type"')
    if {"minLength", "maxLength"} & set(node) and {"pattern", "format"} & set(node):
        raise InvalidRequestError(
            field, f"minLength/maxLength with pattern or format at {path} (the lengths would not be enforced)"
        )
    required = node.get("required") or []
    properties = node.get("properties") or {}
    missing = [r for r in required if r not in properties]
    if missing:
        raise InvalidRequestError(field, f"required {missing[0]!r} at {path} is not among its properties")


_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")


def _subschemas(node: dict[str, Any], path: str, depth: int) -> Iterator[tuple[str, dict[str, Any], int]]:
    """Every sub-schema with its JSON pointer and depth, iteratively (no recursion limit to hit)."""
    stack = [(path, node, depth)]
    while stack:
        path, node, depth = stack.pop()
        yield path, node, depth
        if depth > MAX_SCHEMA_DEPTH:
            return
        for key in _SCHEMA_MAPS:
            children = node.get(key)
            if isinstance(children, dict):
                for name, child in children.items():
                    if isinstance(child, dict):
                        stack.append((f"{path}/{key}/{name}", child, depth + 1))
        for key in _SCHEMA_LISTS:
            children = node.get(key)
            if isinstance(children, list):
                for i, child in enumerate(children):
                    if isinstance(child, dict):
                        stack.append((f"{path}/{key}/{i}", child, depth + 1))
        for key in _SCHEMA_VALUES:
            child = node.get(key)
            if isinstance(child, dict):
                stack.append((f"{path}/{key}", child, depth + 1))
