"""A request's structured-output fields -> one ``Constraint`` (pure; the one place it is done).

The HTTP API's ``response_format``, the vLLM extras (``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``, ``structured_outputs``) and chat's ``tools`` /
``tool_choice``, and the gRPC API's ``constraint`` oneof, all end here. At most one constraint
per request: two are refused naming both fields. Every constraint is checked
(``check_constraint``) with the error naming the field the client sent, so a cap or an
unsupported schema keyword is a 400 with the right ``param``.

Tool calls are constrained, never guessed from free text:

- ``tool_choice`` "required": the output is a non-empty JSON array of
  ``{"name": <a tool's name>, "arguments": <that tool's parameters>}``;
- a named function: the output is that function's arguments (its parameters schema);
- "auto" (OpenAI's default with tools) needs a model-specific parser of free text; none is
  implemented for any model, so it is refused, saying what to send instead;
- "none": the tools are neither shown nor used.

``ToolCallFormat`` tells the response formatter how to read a tool-call output
(``router/tool_calls.py``).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.structured.constraint import (
    Constraint,
    ConstraintKind,
    canonical_json,
    check_constraint,
    check_schema,
)
from pdserve.router.errors import Code, RouterError
from pdserve.router.openai_models import (
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    SamplingFields,
    Tool,
)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
NO_PARSER = "no tool-call parser is implemented for this model"


class ToolCallMode(enum.Enum):
    NAMED = "named"  # the output is the named function's arguments
    REQUIRED = "required"  # the output is a JSON array of {"name", "arguments"}


@dataclass(frozen=True)
class ToolCallFormat:
    """How a tool-call request's output becomes ``tool_calls``: ``name`` for ``NAMED``."""

    mode: ToolCallMode
    name: str = ""


@dataclass(frozen=True)
class StructuredRequest:
    """What a request asks of its output: the constraint (``None``: free text), how to read a
    tool-call output (``None``: as content), and the tools to show the model."""

    constraint: Constraint | None = None
    tool_format: ToolCallFormat | None = None
    tools: tuple[Tool, ...] = ()


def invalid(field: str, message: str) -> RouterError:
    return RouterError(Code.INVALID_ARGUMENT, f"{field}: {message}", field)


def checked(c: Constraint, field: str) -> Constraint:
    """``c`` if it passes the structural checks, else a 400 naming ``field``. Every constraint
    either API makes passes here; the compile check follows (``Router.check_constraint``)."""
    try:
        check_constraint(c)
    except InvalidRequestError as e:
        raise invalid(field, e.message) from None
    return c


def schema_constraint(schema: Any, field: str) -> Constraint:
    """A JSON-schema constraint from a schema (a dict or bool, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise invalid(field, f"is not valid JSON: {e}") from None
    try:
        check_schema(schema, field)  # before encoding it: depth and size come first
        return checked(Constraint.json_schema(schema), field)
    except InvalidRequestError as e:
        raise invalid(field, e.message) from None


def make_constraint(kind: ConstraintKind, value: Any, field: str) -> Constraint:
    """One constraint of ``kind`` from a field's value (the HTTP and gRPC APIs' common step)."""
    if kind is ConstraintKind.JSON_SCHEMA:
        return schema_constraint(value, field)
    if kind is ConstraintKind.CHOICE:
        try:
            return checked(Constraint.choice(list(value)), field)
        except InvalidRequestError as e:
            raise invalid(field, e.message) from None
    if kind is ConstraintKind.JSON_OBJECT:
        return checked(Constraint(kind), field)
    return checked(Constraint(kind, value), field)


def constraint_from_openai(body: SamplingFields, template_uses_tools: bool = False) -> StructuredRequest:
    """The structured-output part of an HTTP request (completions or chat)."""
    found: list[tuple[str, Constraint]] = []
    rf = body.response_format
    if isinstance(rf, JsonObjectFormat):
        found.append(
            ("response_format", make_constraint(ConstraintKind.JSON_OBJECT, None, "response_format"))
        )
    elif isinstance(rf, JsonSchemaFormat):
        schema = rf.json_schema.schema_
        field = "response_format.json_schema.schema"
        kind = ConstraintKind.JSON_OBJECT if schema is None else ConstraintKind.JSON_SCHEMA
        c = make_constraint(kind, schema, field)
        found.append(("response_format", c))
    extras: tuple[tuple[str, ConstraintKind, Any], ...] = (
        ("guided_json", ConstraintKind.JSON_SCHEMA, body.guided_json),
        ("guided_regex", ConstraintKind.REGEX, body.guided_regex),
        ("guided_choice", ConstraintKind.CHOICE, body.guided_choice),
        ("guided_grammar", ConstraintKind.GRAMMAR, body.guided_grammar),
    )
    for field, kind, value in extras:
        if value is not None:
            found.append((field, make_constraint(kind, value, field)))
    so = body.structured_outputs
    if so is not None:
        nested: tuple[tuple[str, ConstraintKind, Any], ...] = (
            ("json", ConstraintKind.JSON_SCHEMA, so.json_),
            ("regex", ConstraintKind.REGEX, so.regex),
            ("choice", ConstraintKind.CHOICE, so.choice),
            ("grammar", ConstraintKind.GRAMMAR, so.grammar),
            ("json_object", ConstraintKind.JSON_OBJECT, so.json_object or None),
        )
        for name, kind, value in nested:
            if value is not None:
                field = f"structured_outputs.{name}"
                found.append((field, make_constraint(kind, value, field)))
    plan = tool_plan(getattr(body, "tools", None), getattr(body, "tool_choice", None), template_uses_tools)
    if plan.constraint is not None:
        found.append(("tool_choice", plan.constraint))
    if len(found) > 1:
        (a, _), (b, _) = found[:2]
        raise invalid(a, f"cannot be combined with {b}: send one structured-output constraint")
    return StructuredRequest(found[0][1] if found else None, plan.tool_format, plan.tools)


def tool_plan(
    tools: Sequence[Tool] | None,
    choice: str | NamedToolChoice | None,
    template_uses_tools: bool = False,
) -> StructuredRequest:
    """``tools`` and ``tool_choice`` -> the constraint, the output's format and the tools shown."""
    tools = list(tools or ())
    names = [t.function.name for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise invalid("tools", f"two tools are named {dup!r}; names must be unique")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return StructuredRequest()
    if not tools:
        raise invalid("tool_choice", "needs tools")
    if choice == "auto":
        why = (
            f"this model's chat template renders tools, but {NO_PARSER}"
            if template_uses_tools
            else f"this model's chat template does not render tools ({NO_PARSER})"
        )
        raise invalid(
            "tool_choice",
            f'"auto" needs a model-specific parser of the free-text answer and {why}; send '
            'tool_choice "required" or {"type": "function", "function": {"name": ...}} '
            "(the output is then constrained to a call)",
        )
    for i, tool in enumerate(tools):  # every tool is shown to the model: all are checked
        try:
            check_schema(parameters_of(tool, i), f"tools.{i}.function.parameters")
        except InvalidRequestError as e:
            raise invalid(e.field, e.message) from None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise invalid("tool_choice", f"names {name!r}, which is not among the tools ({', '.join(names)})")
        i = names.index(name)
        c = schema_constraint(parameters_of(tools[i], i), f"tools.{i}.function.parameters")
        return StructuredRequest(c, ToolCallFormat(ToolCallMode.NAMED, name), tuple(tools))
    return StructuredRequest(
        checked(tool_schema_for(tools), "tools"), ToolCallFormat(ToolCallMode.REQUIRED), tuple(tools)
    )


def parameters_of(tool: Tool, index: int) -> dict[str, Any]:
    """A tool's parameters schema: an object's (OpenAI's arguments are always an object)."""
    params = tool.function.parameters
    if params is None:
        return EMPTY_PARAMETERS
    if params.get("type") != "object":
        raise invalid(f"tools.{index}.function.parameters", 'must be an object schema ("type": "object")')
    return params


def tool_schema_for(tools: Sequence[Tool]) -> Constraint:
    """The schema of ``tool_choice: "required"``'s output: a non-empty array of calls, each one
    of the tools' ``{"name": const, "arguments": parameters}``. Each tool's local definitions
    move to the top-level ``$defs`` (prefixed by its name) so its ``$ref``s still resolve."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        field = f"tools.{i}.function.parameters"
        params = parameters_of(tool, i)
        try:
            check_schema(params, field)
        except InvalidRequestError as e:
            raise invalid(field, e.message) from None
        prefix = f"{tool.function.name}__"
        params = _relocate(params, prefix, field)
        for key in ("$defs", "definitions"):
            for name, sub in (params.pop(key, None) or {}).items():
                defs[prefix + name] = sub
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if defs:
        schema["$defs"] = defs
    try:
        return Constraint(ConstraintKind.JSON_SCHEMA, canonical_json(schema, "tools"))
    except InvalidRequestError as e:
        raise invalid("tools", e.message) from None


_MAPS = ("properties", "$defs", "definitions")
_LISTS = ("anyOf", "prefixItems")
_VALUES = ("items", "additionalProperties")
_LOCAL = ("#/$defs/", "#/definitions/")


def _relocate(node: Any, prefix: str, field: str) -> Any:
    """A copy of a (checked, so shallow) schema with its local ``$ref``s pointing into the
    combined schema's ``$defs``."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    ref = out.get("$ref")
    if isinstance(ref, str):
        local = next((p for p in _LOCAL if ref.startswith(p)), None)
        if local is None:
            raise invalid(field, f"$ref {ref!r}: with several tools only '#/$defs/...' refs can be used")
        out["$ref"] = "#/$defs/" + prefix + ref[len(local) :]
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _relocate(v, prefix, field) for k, v in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_relocate(v, prefix, field) for v in out[key]]
    for key in _VALUES:
        if key in out:
            out[key] = _relocate(out[key], prefix, field)
    return out
