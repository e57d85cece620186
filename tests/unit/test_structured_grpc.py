"""The gRPC API's constraint oneof -> the same Constraint as the HTTP API's fields; an invalid
one is INVALID_ARGUMENT naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.model_runtime.structured.constraint import Constraint, ConstraintKind
from pdserve.router.errors import Code, RouterError
from pdserve.router.grpc_api import constraint
from pdserve.v1 import inference_pb2 as pb
from tests.unit.test_structured_api import SCHEMA, deep_schema


@pytest.mark.parametrize(
    ("request_fields", "expected"),
    [
        ({}, None),
        ({"json_schema": json.dumps(SCHEMA)}, Constraint.json_schema(SCHEMA)),
        ({"json_object": True}, Constraint(ConstraintKind.JSON_OBJECT)),
        ({"json_object": False}, None),
        ({"regex": "[0-9]+"}, Constraint(ConstraintKind.REGEX, "[0-9]+")),
        ({"choice": pb.ChoiceList(options=["a", "b"])}, Constraint.choice(["a", "b"])),
        ({"grammar": 'root ::= "a"'}, Constraint(ConstraintKind.GRAMMAR, 'root ::= "a"')),
    ],
)
def test_the_grpc_oneof_becomes_the_same_constraint(
    request_fields: dict[str, Any], expected: Constraint | None
) -> None:
    assert constraint(pb.GenerateRequest(text="p", **request_fields)) == expected


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"json_schema": "{"}, "json_schema"),
        ({"json_schema": json.dumps(deep_schema(100))}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"choice": pb.ChoiceList()}, "choice"),
        ({"grammar": ""}, "grammar"),
    ],
)
def test_an_invalid_grpc_constraint_names_its_field(request_fields: dict[str, Any], field: str) -> None:
    with pytest.raises(RouterError) as e:
        constraint(pb.GenerateRequest(text="p", **request_fields))
    assert (
        e.value.code is Code.INVALID_ARGUMENT and e.value.field == field and e.value.message.startswith(field)
    )
