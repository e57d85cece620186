"""Every JSON Schema keyword and string format ``check_constraint`` admits is enforced.

``SCHEMA_KEYWORDS`` and ``FORMATS`` promise that the compiled grammar enforces what they list:
a keyword the engine ignored would let through output the client's validator rejects, with a
200. For each, a small schema, a document that conforms (accepted token by token, then EOS)
and one that violates that keyword (refused at some token, or EOS not allowed at its end);
jsonschema confirms which document is which. Schemas that combine admitted keywords must be
either refused by ``check_constraint`` or enforced too. The grammar is the worker's
(``Grammars``), on the ``tiny`` model's byte vocabulary (every token one byte), so the walk
sees every byte of the document; documents are written as the grammar emits them (separators
``", "`` and ``": "``, keys in the schema's own order, no other whitespace).
"""

from __future__ import annotations

import datetime
import json
import re
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.structured.compiler import Grammars
from pdserve.model_runtime.structured.constraint import (
    FORMATS,
    MAX_ENUM_VALUES,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_BYTES,
    SCHEMA_KEYWORDS,
    Constraint,
    ConstraintKind,
    check_constraint,
)
from tests.unit.tiny_grammars import tiny_grammars

Schema = dict[str, Any]
INT = {"type": "integer"}
STR = {"type": "string"}


def _obj(props: Schema, required: list[str] | None = None, **more: Any) -> Schema:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        **more,
    }


# keyword -> (schema, a document that conforms, one that violates the keyword)
KEYWORD_CASES: dict[str, tuple[Schema, str, str]] = {
    "type": ({"type": "integer"}, "12", "1.5"),
    "properties": (_obj({"a": INT}), '{"a": 1}', '{"a": "x"}'),
    "required": (_obj({"a": INT, "b": INT}, required=["a"]), '{"a": 1}', '{"b": 2}'),
    "additionalProperties": (
        {"type": "object", "additionalProperties": INT},
        '{"n": 1}',
        '{"n": "x"}',
    ),
    "items": ({"type": "array", "items": INT}, "[1, 2]", '[1, "2"]'),
    "prefixItems": ({"type": "array", "prefixItems": [INT, STR], "items": False}, '[1, "a"]', '[1, "a", 3]'),
    "minItems": ({"type": "array", "items": INT, "minItems": 2}, "[1, 2]", "[1]"),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 2}, "[1, 2]", "[1, 2, 3]"),
    "enum": ({"enum": ["red", 7, None]}, '"red"', '"blue"'),
    "const": ({"const": "on"}, '"on"', '"off"'),
    "anyOf": ({"anyOf": [INT, {"type": "null"}]}, "null", '"x"'),
    "$ref": (
        {"$defs": {"pos": {"type": "integer", "minimum": 1}}, "$ref": "#/$defs/pos"},
        "3",
        "0",
    ),
    "$defs": (
        _obj({"a": {"$ref": "#/$defs/flag"}}) | {"$defs": {"flag": {"type": "boolean"}}},
        '{"a": true}',
        '{"a": 1}',
    ),
    "definitions": (
        _obj({"a": {"$ref": "#/definitions/flag"}}) | {"definitions": {"flag": {"type": "boolean"}}},
        '{"a": false}',
        '{"a": "no"}',
    ),
    "minLength": ({"type": "string", "minLength": 3}, '"abc"', '"ab"'),
    "maxLength": ({"type": "string", "maxLength": 3}, '"abc"', '"abcd"'),
    "pattern": ({"type": "string", "pattern": "^[a-z]{2}-[0-9]{2}$"}, '"ab-12"', '"ab-1x"'),
    "minimum": ({"type": "number", "minimum": 1.5}, "1.5", "1.25"),
    "maximum": ({"type": "integer", "maximum": 10}, "10", "11"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, "6", "5"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 1}, "0.5", "1"),
    "format": ({"type": "string", "format": "date"}, '"2024-02-29"', '"2024-13-01"'),
}

# format -> (a string that conforms, one that does not)
FORMAT_CASES: dict[str, tuple[str, str]] = {
    "date": ("2024-02-29", "2024-2-29"),
    "time": ("12:30:05Z", "25:30:05Z"),
    "date-time": ("2024-02-29T12:30:05+01:00", "2024-02-29 12:30:05Z"),
    "email": ("ada.l@example.com", "ada.l.example.com"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "123e4567-e89b-12d3-a456-42661417400g"),
    "ipv4": ("192.168.0.1", "192.168.0.256"),
    "ipv6": ("2001:db8::1", "2001:db8:::1"),
    "uri": ("https://example.com/a?b=c", "example dot com"),
    "hostname": ("api.example.com", "-api.example.com"),
}

# Admitted keywords in combination: each must be refused up front or enforced (its violating
# document refused). name -> (schema, conforming document, violating document)
COMBINATION_CASES: dict[str, tuple[Schema, str, str]] = {
    "maxLength with pattern": ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aa"', '"aaa"'),
    "maxLength with format": (
        {"type": "string", "format": "email", "maxLength": 8},
        '"a@b.com"',
        '"ab@cd.com"',
    ),
    "minLength without type": ({"minLength": 3}, '"abc"', '"ab"'),
    "minimum without type": ({"minimum": 5}, "5", "4"),
    "pattern without type": ({"pattern": "^a+$"}, '"aa"', '"b"'),
    "format without type": ({"format": "date"}, '"2024-01-01"', '"soon"'),
    "type beside enum": ({"type": "string", "enum": ["a", 1]}, '"a"', "1"),
    "maxLength beside $ref": ({"$defs": {"s": STR}, "$ref": "#/$defs/s", "maxLength": 2}, '"ab"', '"abc"'),
    "required beside anyOf": (
        _obj({"a": INT, "b": INT}, required=[], anyOf=[{"required": ["a"]}, {"required": ["b"]}]),
        '{"a": 1}',
        "{}",
    ),
    "required with additionalProperties": (
        {"type": "object", "additionalProperties": INT, "required": ["x"]},
        '{"x": 1}',
        "{}",
    ),
    "required not in properties": (_obj({"a": INT}, required=["a", "b"]), '{"a": 1, "b": 2}', '{"a": 1}'),
    "type list with minimum": ({"type": ["integer", "null"], "minimum": 5}, "5", "4"),
    "minItems with prefixItems": (
        {"type": "array", "prefixItems": [INT, INT], "minItems": 2},
        "[1, 2]",
        "[1]",
    ),
}


def _time(s: str) -> bool:
    try:
        datetime.time.fromisoformat(s)
    except ValueError:
        return False
    return s[-1] == "Z" or "+" in s or "-" in s


def _date_time(s: str) -> bool:
    try:
        datetime.datetime.fromisoformat(s)
    except ValueError:
        return False
    return "T" in s


def _uri(s: str) -> bool:
    u = urllib.parse.urlsplit(s)
    return bool(u.scheme) and " " not in s


def _hostname(s: str) -> bool:
    return all(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", part) for part in s.split("."))


# The formats jsonschema checks without extra packages, and plain checks for the rest.
_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
_ORACLES: dict[str, Callable[[str], bool]] = {
    "time": _time,
    "date-time": _date_time,
    "uri": _uri,
    "hostname": _hostname,
}


def _valid(schema: Schema, doc: str) -> bool:
    value = json.loads(doc)
    if not jsonschema.Draft202012Validator(schema, format_checker=_CHECKER).is_valid(value):
        return False
    fmt = schema.get("format")
    if fmt in _ORACLES and fmt not in _CHECKER.checkers and isinstance(value, str):
        return _ORACLES[fmt](value)
    return True


@pytest.fixture(scope="module")
def grammars() -> Iterator[Grammars]:
    g = tiny_grammars()
    yield g
    g.close()


def _compiled(grammars: Grammars, c: Constraint) -> xgr.CompiledGrammar:
    grammars.check(c)
    return grammars.compiled(c)


def walk(grammars: Grammars, c: Constraint, doc: str) -> str:
    """'' when the grammar accepts ``doc`` and then EOS; else where it stopped."""
    ids = grammars.tokenizer.backend.encode(doc, add_special_tokens=False).ids
    assert bytes(ids) == doc.encode(), "the tiny vocabulary is one token a byte"
    m = xgr.GrammarMatcher(_compiled(grammars, c))
    for k, t in enumerate(ids):
        if not m.accept_token(t):
            return f"refused at byte {k}: {doc.encode()[: k + 1]!r}"
    if not m.accept_token(grammars.eos_ids[0]):
        return "EOS not allowed at the end"
    return ""


def _enforced(grammars: Grammars, schema: Schema, good: str, bad: str) -> None:
    assert _valid(schema, good), f"the conforming document {good} does not validate"
    assert not _valid(schema, bad), f"the violating document {bad} validates"
    c = Constraint.json_schema(schema)
    assert walk(grammars, c, good) == "", f"{good} refused: {walk(grammars, c, good)}"
    assert walk(grammars, c, bad) != "", f"{bad} accepted: the grammar does not enforce {schema}"


def test_every_admitted_keyword_and_format_has_a_case() -> None:
    assert set(KEYWORD_CASES) == SCHEMA_KEYWORDS
    assert set(FORMAT_CASES) == FORMATS


@pytest.mark.parametrize("keyword", sorted(KEYWORD_CASES))
def test_keyword_is_enforced(grammars: Grammars, keyword: str) -> None:
    schema, good, bad = KEYWORD_CASES[keyword]
    assert keyword in json.dumps(schema)
    check_constraint(Constraint.json_schema(schema))
    _enforced(grammars, schema, good, bad)


@pytest.mark.parametrize("fmt", sorted(FORMAT_CASES))
def test_format_is_enforced(grammars: Grammars, fmt: str) -> None:
    good, bad = FORMAT_CASES[fmt]
    schema = {"type": "string", "format": fmt}
    check_constraint(Constraint.json_schema(schema))
    _enforced(grammars, schema, json.dumps(good), json.dumps(bad))


@pytest.mark.parametrize("name", sorted(COMBINATION_CASES))
def test_combined_keywords_are_refused_or_enforced(grammars: Grammars, name: str) -> None:
    schema, good, bad = COMBINATION_CASES[name]
    try:
        check_constraint(Constraint.json_schema(schema))
    except InvalidRequestError as e:
        assert e.field == "response_format"
        return
    _enforced(grammars, schema, good, bad)


def _refused(c: Constraint, *words: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        check_constraint(c)
    for w in words:
        assert w in str(info.value)
    return info.value


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("not", {"type": "null"}),
        ("if", {"type": "integer"}),
        ("patternProperties", {"^x": INT}),
        ("uniqueItems", True),
        ("oneOf", [INT, STR]),
        ("minProperties", 2),
        ("allOf", [INT]),
        ("multipleOf", 2),
        ("contains", INT),
        ("dependentRequired", {"a": ["b"]}),
        ("propertyNames", {"maxLength": 3}),
    ],
)
def test_keywords_outside_the_list_are_refused(keyword: str, value: Any) -> None:
    assert keyword not in SCHEMA_KEYWORDS
    top = Constraint.json_schema({"type": "object", keyword: value})
    assert _refused(top, repr(keyword), "#").field == "response_format"
    nested = Constraint.json_schema(_obj({"a": {"type": "object", keyword: value}}))
    _refused(nested, repr(keyword), "#/properties/a")


def test_neutral_values_of_unlisted_keywords_pass() -> None:
    check_constraint(Constraint.json_schema({"type": "array", "uniqueItems": False, "items": INT}))
    check_constraint(Constraint.json_schema({"type": "object", "minProperties": 0}))


def test_unlisted_formats_and_remote_refs_are_refused() -> None:
    _refused(Constraint.json_schema({"type": "string", "format": "duration"}), "'duration'")
    for ref in ("https://example.com/schema.json", "other.json#/$defs/a", "/abs"):
        _refused(Constraint.json_schema(_obj({"a": {"$ref": ref}})), "$ref", repr(ref))


def _nested(depth: int) -> Schema:
    schema: Schema = INT
    for _ in range(depth):
        schema = _obj({"a": schema})
    return schema


def test_depth_cap() -> None:
    check_constraint(Constraint.json_schema(_nested(MAX_SCHEMA_DEPTH)))
    _refused(Constraint.json_schema(_nested(MAX_SCHEMA_DEPTH + 1)), "deeper", str(MAX_SCHEMA_DEPTH))


def test_enum_cap() -> None:
    check_constraint(Constraint.json_schema({"enum": list(range(MAX_ENUM_VALUES))}))
    _refused(Constraint.json_schema({"enum": list(range(MAX_ENUM_VALUES + 1))}), str(MAX_ENUM_VALUES))


def test_oversize_specs_are_refused() -> None:
    big = "x" * (MAX_SPEC_BYTES + 1)
    _refused(Constraint.json_schema({"type": "string", "description": big}), "bytes", str(MAX_SPEC_BYTES))
    assert _refused(Constraint(ConstraintKind.REGEX, big), "bytes").field == "regex"
    assert _refused(Constraint(ConstraintKind.GRAMMAR, f'root ::= "{big}"'), "bytes").field == "grammar"
    options = [f"option {i:05d}" for i in range(MAX_SPEC_BYTES // 10)]
    assert _refused(Constraint.choice(options), "bytes").field == "choice"


def _compile_refused(grammars: Grammars, c: Constraint) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        grammars.check(c)
    with pytest.raises(InvalidRequestError):
        grammars.compiled(c)
    return info.value


def test_the_compiler_refuses_what_only_compiling_tells(grammars: Grammars) -> None:
    nothing = _compile_refused(grammars, Constraint(ConstraintKind.REGEX, r"[^\s\S]"))
    assert nothing.field == "regex" and "matches no output" in nothing.message
    undefined = _compile_refused(grammars, Constraint(ConstraintKind.GRAMMAR, "root ::= missing_rule"))
    assert undefined.field == "grammar" and "missing_rule" in undefined.message
    assert walk(grammars, Constraint(ConstraintKind.GRAMMAR, 'root ::= "a" rest\nrest ::= "b"'), "ab") == ""


def test_equal_schemas_share_one_compile_and_keep_their_key_order(grammars: Grammars) -> None:
    kj = {"type": "object", "properties": {"k": INT, "j": STR}, "required": ["k", "j"]}
    one = Constraint.json_schema(kj)
    same = Constraint.json_schema(json.loads(json.dumps(kj)))
    before = grammars.compiles
    assert walk(grammars, one, '{"k": 1, "j": "x"}') == ""
    assert walk(grammars, same, '{"k": 2, "j": "y"}') == ""
    assert grammars.compiles == before + 1
    # The output's properties follow the schema's order: another order is another language.
    other = Constraint.json_schema({**kj, "properties": {"j": STR, "k": INT}})
    assert other != one
    assert walk(grammars, other, '{"j": "x", "k": 1}') == ""
    assert walk(grammars, one, '{"j": "x", "k": 1}') != ""
    assert grammars.compiles == before + 2
