"""The API's structured-output fields -> one Constraint: every field, conflicts, tools and
tool_choice, hostile inputs (each a 400 naming the field)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.model_runtime.structured.constraint import (
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_BYTES,
    Constraint,
    ConstraintKind,
)
from pdserve.router.errors import Code, RouterError
from pdserve.router.openai_models import ChatCompletionRequest, CompletionRequest
from pdserve.router.structured_api import (
    ToolCallFormat,
    ToolCallMode,
    constraint_from_openai,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"],
            "$defs": {"City": {"type": "string", "maxLength": 40}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def refused(field: str, **fields: Any) -> str:
    with pytest.raises(RouterError) as e:
        constraint_from_openai(chat(**fields))
    assert e.value.code is Code.INVALID_ARGUMENT and e.value.field == field, e.value.message
    return e.value.message


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Constraint(ConstraintKind.JSON_OBJECT)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": SCHEMA, "strict": True},
                }
            },
            Constraint.json_schema(SCHEMA),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
            Constraint(ConstraintKind.JSON_OBJECT),
        ),
        ({"guided_json": SCHEMA}, Constraint.json_schema(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, Constraint.json_schema(SCHEMA)),
        ({"guided_regex": "[a-z]+"}, Constraint(ConstraintKind.REGEX, "[a-z]+")),
        ({"guided_choice": ["yes", "no"]}, Constraint.choice(["yes", "no"])),
        ({"guided_grammar": 'root ::= "a"'}, Constraint(ConstraintKind.GRAMMAR, 'root ::= "a"')),
        ({"structured_outputs": {"json": SCHEMA}}, Constraint.json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": "x"}}, Constraint(ConstraintKind.REGEX, "x")),
        ({"structured_outputs": {"choice": ["a"]}}, Constraint.choice(["a"])),
        (
            {"structured_outputs": {"grammar": 'root ::= "b"'}},
            Constraint(ConstraintKind.GRAMMAR, 'root ::= "b"'),
        ),
        ({"structured_outputs": {"json_object": True}}, Constraint(ConstraintKind.JSON_OBJECT)),
        ({}, None),
    ],
)
def test_each_field_becomes_its_constraint(fields: dict[str, Any], expected: Constraint | None) -> None:
    assert constraint_from_openai(chat(**fields)).constraint == expected
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "p", **fields})
    assert constraint_from_openai(completion).constraint == expected


@pytest.mark.parametrize(
    ("fields", "first", "second"),
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format",
            "guided_regex",
        ),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_json", "guided_choice"),
        (
            {"guided_grammar": "root ::= x", "structured_outputs": {"regex": "a"}},
            "guided_grammar",
            "structured_outputs.regex",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "grammar": "g"}},
            "structured_outputs.json",
            "structured_outputs.grammar",
        ),
        (
            {"response_format": {"type": "json_object"}, "tools": [TIME], "tool_choice": "required"},
            "response_format",
            "tool_choice",
        ),
    ],
)
def test_two_constraints_are_refused_naming_both(fields: dict[str, Any], first: str, second: str) -> None:
    assert second in refused(first, **fields)


def deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(
    ("field", "fields", "words"),
    [
        ("guided_json", {"guided_json": deep_schema(MAX_SCHEMA_DEPTH + 5)}, "deeper"),
        ("guided_json", {"guided_json": deep_schema(5000)}, "deeper"),  # no recursion error
        ("guided_json", {"guided_json": "{not json"}, "not valid JSON"),
        ("guided_json", {"guided_json": {"type": "string", "not": {}}}, "unsupported JSON Schema feature"),
        (
            "response_format.json_schema.schema",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": {"$ref": "http://x/s"}},
                }
            },
            "local $ref",
        ),
        (
            "guided_json",
            {
                "guided_json": {
                    "type": "object",
                    "properties": {f"p{i}": {"type": "string"} for i in range(4000)},
                }
            },
            "bytes",
        ),
        ("guided_regex", {"guided_regex": ""}, "empty"),
        ("guided_choice", {"guided_choice": []}, "non-empty"),
        ("guided_choice", {"guided_choice": ["a", "a"]}, "distinct"),
        ("guided_grammar", {"guided_grammar": "  "}, "empty"),
    ],
)
def test_hostile_constraints_are_400s_naming_the_field(
    field: str, fields: dict[str, Any], words: str
) -> None:
    assert words in refused(field, **fields)


def test_field_sizes_are_bounded_before_translation() -> None:
    for fields in (
        {"guided_regex": "a" * 5000},
        {"guided_choice": ["x"] * 2000},
        {"guided_grammar": "g" * (MAX_SPEC_BYTES + 1)},
        {"tools": [TIME] * 129, "tool_choice": "required"},
    ):
        with pytest.raises(ValidationError):
            chat(**fields)


def test_required_is_an_array_of_calls_with_each_tools_arguments() -> None:
    got = constraint_from_openai(chat(tools=[WEATHER, TIME], tool_choice="required"))
    assert got.tool_format == ToolCallFormat(ToolCallMode.REQUIRED)
    assert [t.function.name for t in got.tools] == ["get_weather", "get_time"]
    assert got.constraint is not None and got.constraint.kind is ConstraintKind.JSON_SCHEMA
    schema = json.loads(got.constraint.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1
    weather, clock = schema["items"]["anyOf"]
    assert weather["required"] == ["name", "arguments"] and weather["additionalProperties"] is False
    assert weather["properties"]["name"] == {"const": "get_weather"}
    # the tool's own definitions move to the top, where its $ref now points
    assert weather["properties"]["arguments"]["properties"]["city"] == {"$ref": "#/$defs/get_weather__City"}
    assert schema["$defs"] == {"get_weather__City": {"type": "string", "maxLength": 40}}
    assert clock["properties"]["arguments"] == {"type": "object", "properties": {}}


def test_a_named_function_is_constrained_to_its_parameters() -> None:
    got = constraint_from_openai(
        chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert got.tool_format == ToolCallFormat(ToolCallMode.NAMED, "get_weather")
    assert got.constraint == Constraint.json_schema(WEATHER["function"]["parameters"])
    got = constraint_from_openai(
        chat(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    )
    assert got.constraint == Constraint.json_schema({"type": "object", "properties": {}})


def test_none_uses_no_tools() -> None:
    got = constraint_from_openai(chat(tools=[WEATHER], tool_choice="none"))
    assert got.constraint is None and got.tool_format is None and got.tools == ()


def test_auto_is_refused_saying_what_to_send() -> None:
    for fields in ({"tools": [TIME]}, {"tools": [TIME], "tool_choice": "auto"}):
        message = refused("tool_choice", **fields)
        assert (
            "required" in message and "no tool-call parser" in message and "does not render tools" in message
        )
    with pytest.raises(RouterError) as e:
        constraint_from_openai(chat(tools=[TIME]), template_uses_tools=True)
    assert "renders tools, but no tool-call parser is implemented" in e.value.message


def test_tool_names_and_choices_are_checked() -> None:
    for name in ("", "has space", "x" * 65, "dot.ted"):
        with pytest.raises(ValidationError):
            chat(tools=[{"type": "function", "function": {"name": name}}], tool_choice="required")
    assert "unique" in refused("tools", tools=[TIME, TIME], tool_choice="required")
    assert "not among the tools" in refused(
        "tool_choice", tools=[TIME], tool_choice={"type": "function", "function": {"name": "nope"}}
    )
    assert "needs tools" in refused("tool_choice", tool_choice="required")
    not_object = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    assert "object schema" in refused(
        "tools.0.function.parameters", tools=[not_object], tool_choice="required"
    )
    deep = {"type": "function", "function": {"name": "f", "parameters": deep_schema(MAX_SCHEMA_DEPTH + 1)}}
    assert "deeper" in refused("tools.0.function.parameters", tools=[deep], tool_choice="required")
    remote = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#"}}}},
    }
    assert "$ref" in refused("tools.0.function.parameters", tools=[remote], tool_choice="required")
