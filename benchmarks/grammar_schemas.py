"""The constraints ``benchmarks/grammar_engines.py`` compiles, each with documents that conform.

Eight JSON schemas of the kinds internal services send (the shapes pydantic writes: ``title``,
``anyOf`` with ``null`` for optional fields, ``$defs`` / ``$ref``), a regular expression and a
choice list. Every document is written the way the compiled grammars expect: keys in the
canonical schema's order (sorted, as ``Constraint.json_schema`` stores them), separators ``", "``
and ``": "``, no other whitespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.model_runtime.structured.constraint import Constraint, ConstraintKind

_STR = {"type": "string"}
_INT = {"type": "integer"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _obj(props: dict[str, Any], optional: tuple[str, ...] = (), title: str = "") -> dict[str, Any]:
    # Properties in sorted order: the documents are written with sorted keys, and the output's
    # properties follow the schema's order.
    out: dict[str, Any] = {
        "type": "object",
        "properties": dict(sorted(props.items())),
        "required": [k for k in props if k not in optional],
        "additionalProperties": False,
    }
    if title:
        out["title"] = title
    return out


INVOICE = _obj(
    {
        "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
        "issued": {"type": "string", "format": "date"},
        "customer": _obj({"name": {"type": "string", "maxLength": 80}, "vat_id": _nullable(_STR)}),
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "line_items": {
            "type": "array",
            "minItems": 1,
            "items": _obj(
                {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "description": _STR,
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number", "minimum": 0},
                },
                title="LineItem",
            ),
        },
        "total": {"type": "number", "minimum": 0},
    },
    title="Invoice",
)

EVENT = _obj(
    {
        "title": {"type": "string", "maxLength": 100},
        "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"},
        "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 50},
        "location": _nullable(_STR),
        "recurrence": {"enum": ["none", "daily", "weekly", "monthly"]},
        "all_day": {"type": "boolean"},
    },
    optional=("location",),
    title="CalendarEvent",
)

ISSUE = _obj(
    {
        "number": {"type": "integer", "minimum": 1},
        "title": {"type": "string", "minLength": 1, "maxLength": 120},
        "state": {"enum": ["open", "closed"]},
        "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs", "question", "wontfix"]}},
        "assignee": _nullable({"type": "string", "pattern": "^[a-z0-9-]{1,39}$"}),
        "body": _STR,
        "milestone": _nullable(_obj({"title": _STR, "due_on": {"type": "string", "format": "date"}})),
    }
)

_ADDRESS = _obj(
    {
        "street": _STR,
        "city": _STR,
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["DE", "FR", "US", "GB", "NL"]},
    }
)
ADDRESS_BOOK = _obj(
    {
        "owner": _STR,
        "contacts": {
            "type": "array",
            "items": _obj(
                {
                    "name": _STR,
                    "emails": {"type": "array", "items": {"type": "string", "format": "email"}},
                    "phones": {"type": "array", "items": {"type": "string", "pattern": "^\\+[0-9]{7,15}$"}},
                    "address": _nullable(_ADDRESS),
                    "tags": {"type": "array", "items": _STR, "maxItems": 5},
                }
            ),
        },
    }
)

TOOL_ARGS = _obj(
    {
        "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
    },
    title="get_weather",
)

CLASSIFICATION = _obj(
    {
        "label": {"enum": ["billing", "technical", "account", "sales", "other"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "rationale": {"type": "string", "maxLength": 200},
    }
)

TREE = {
    "$defs": {
        "Node": _obj(
            {
                "name": _STR,
                "size": {"type": "integer", "minimum": 0},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
            },
            title="Node",
        )
    },
    "$ref": "#/$defs/Node",
}

PROFILE = _obj(
    {
        "id": {"type": "string", "format": "uuid"},
        "handle": {"type": "string", "pattern": "^@[a-z_][a-z0-9_]{2,14}$"},
        "display_name": _nullable({"type": "string", "maxLength": 50}),
        "website": _nullable({"type": "string", "format": "uri"}),
        "age": _nullable({"type": "integer", "minimum": 13, "maximum": 130}),
        "score": {"anyOf": [{"type": "number"}, {"type": "string", "pattern": "^n/a$"}]},
        "ip": {"type": "string", "format": "ipv4"},
    },
    optional=("display_name",),
)

PHONE_REGEX = r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
CHOICES = ["positive", "negative", "neutral", "mixed", "not applicable"]


@dataclass(frozen=True)
class Case:
    name: str
    constraint: Constraint
    documents: tuple[str, ...]
    schema: dict[str, Any] | None = None  # for a JSON schema: what the documents validate against


def _doc(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), ensure_ascii=False)


def _schema_case(name: str, schema: dict[str, Any], *docs: Any) -> Case:
    return Case(name, Constraint.json_schema(schema), tuple(_doc(d) for d in docs), schema)


def cases() -> list[Case]:
    item = {"sku": "ABC-1234", "description": "Widget, blue", "quantity": 3, "unit_price": 19.99}
    node = {"name": "src", "size": 0, "children": [{"name": "main.py", "size": 2048, "children": []}]}
    return [
        _schema_case(
            "invoice",
            INVOICE,
            {
                "invoice_id": "INV-004217",
                "issued": "2026-11-30",
                "customer": {"name": "Acme GmbH", "vat_id": "DE123456789"},
                "currency": "EUR",
                "line_items": [item, {**item, "sku": "XYZ-0042", "quantity": 1, "unit_price": 250}],
                "total": 309.97,
            },
        ),
        _schema_case(
            "calendar_event",
            EVENT,
            {
                "title": "Quarterly planning",
                "start": "2026-12-08T09:30:00Z",
                "end": "2026-12-08T11:00:00+01:00",
                "attendees": ["ana@example.com", "li.wei@example.org"],
                "location": None,
                "recurrence": "none",
                "all_day": False,
            },
        ),
        _schema_case(
            "github_issue",
            ISSUE,
            {
                "number": 4711,
                "title": "Decode worker drops the first token after migration",
                "state": "open",
                "labels": ["bug", "question"],
                "assignee": "octo-cat",
                "body": "Steps to reproduce:\n1. start two decode workers\n2. kill one mid-stream",
                "milestone": {"title": "v0.9", "due_on": "2027-01-15"},
            },
        ),
        _schema_case(
            "address_book",
            ADDRESS_BOOK,
            {
                "owner": "Jo",
                "contacts": [
                    {
                        "name": "Marie Curie",
                        "emails": ["marie@example.fr"],
                        "phones": ["+33142345678"],
                        "address": {
                            "street": "11 rue Pierre et Marie Curie",
                            "city": "Paris",
                            "postal_code": "75005",
                            "country": "FR",
                        },
                        "tags": ["science", "family"],
                    },
                    {"name": "Bob", "emails": [], "phones": [], "address": None, "tags": []},
                ],
            },
        ),
        _schema_case(
            "tool_call_args",
            TOOL_ARGS,
            {"location": "Paris, France", "unit": "celsius", "days": 5, "include_hourly": True},
        ),
        _schema_case(
            "classification",
            CLASSIFICATION,
            {"label": "billing", "confidence": 0.87, "rationale": "The customer asks about a refund."},
        ),
        _schema_case("recursive_tree", TREE, node, {"name": "leaf", "size": 1, "children": []}),
        _schema_case(
            "profile_anyof",
            PROFILE,
            {
                "id": "123e4567-e89b-12d3-a456-426614174000",
                "handle": "@ada_l",
                "display_name": "Ada",
                "website": "https://example.com/ada",
                "age": None,
                "score": "n/a",
                "ip": "10.0.0.12",
            },
            {
                "id": "00000000-0000-4000-8000-000000000001",
                "handle": "@grace",
                "website": None,
                "age": 85,
                "score": 97.5,
                "ip": "192.168.1.1",
            },
        ),
        Case(
            "phone_regex",
            Constraint(ConstraintKind.REGEX, PHONE_REGEX),
            ("+1-415-555-0134", "+1-212-555-0199 ext. 42"),
        ),
        Case("choice", Constraint.choice(CHOICES), ("neutral", "not applicable")),
    ]
