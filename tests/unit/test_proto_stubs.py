"""The pdserve.v1 gRPC stubs: committed output matches a fresh regeneration, messages round-trip
with proto3 presence semantics, and every declaration in the .proto is documented."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_FILE = REPO_ROOT / "proto" / "pdserve" / "v1" / "inference.proto"
EXPECTED_STUBS = {"inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"}


def _load_generate_script() -> ModuleType:
    path = REPO_ROOT / "proto" / "generate.py"
    spec = importlib.util.spec_from_file_location("pdserve_proto_generate", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- (a) committed stubs == fresh regeneration --------------------------------------------------


def test_committed_stubs_match_regeneration(tmp_path: Path) -> None:
    generate = _load_generate_script().generate
    written: list[Path] = generate(tmp_path)
    assert {p.name for p in written} == EXPECTED_STUBS
    for fresh in written:
        rel = fresh.relative_to(tmp_path)
        assert rel.parent == Path("pdserve/v1"), f"unexpected output location {rel}"
        committed = REPO_ROOT / rel
        hint = f"{rel} is stale or missing: run `python proto/generate.py` and commit the result"
        assert committed.is_file(), hint
        fresh_bytes = fresh.read_bytes()
        assert str(tmp_path).encode() not in fresh_bytes, f"{rel} embeds the output path"
        assert committed.read_bytes() == fresh_bytes, hint


# --- (b) round trip and presence semantics ------------------------------------------------------


def _full_sampling() -> pb.SamplingParameters:
    """Every field set to a non-default value (floats exactly representable in float32)."""
    return pb.SamplingParameters(
        max_tokens=64,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.125,
        repetition_penalty=1.25,
        frequency_penalty=-1.5,
        presence_penalty=0.5,
        seed=2**63 + 7,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 32000],
        include_stop_str_in_output=True,
        ignore_eos=True,
        min_tokens=3,
        logprobs=5,
    )


def test_generate_request_round_trip() -> None:
    req = pb.GenerateRequest(
        request_id="req-1",
        token_ids=pb.TokenIds(ids=[1, 15043, 2**32 - 1]),
        sampling=_full_sampling(),
        stream=True,
        slo=pb.SloHint(ttft_ms=250.0, tpot_ms=50.0, priority=-1, slo_class="chat"),
        return_prompt_token_ids=True,
        choice=pb.ChoiceList(options=["yes", "no"]),
    )
    # The test must cover every field: a field added to the .proto has to be set here too.
    for msg in (req, req.sampling, req.slo):
        missing = {f.name for f in msg.DESCRIPTOR.fields} - {f.name for f, _ in msg.ListFields()}
        if msg is req:
            missing -= {"text"}  # the other member of the prompt oneof
            missing -= {"json_schema", "json_object", "regex", "grammar"}  # the constraint's (below)
        assert not missing, f"{msg.DESCRIPTOR.name}: fields not set by this test: {sorted(missing)}"
    for which, value in (("json_schema", '{"type": "object"}'), ("json_object", True), ("regex", "a+"),
                         ("grammar", 'root ::= "a"')):  # fmt: skip
        other = pb.GenerateRequest.FromString(pb.GenerateRequest(**{which: value}).SerializeToString())
        assert other.WhichOneof("constraint") == which and getattr(other, which) == value

    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("prompt") == "token_ids"
    assert not back.HasField("text")
    assert list(back.token_ids.ids) == [1, 15043, 2**32 - 1]
    assert back.WhichOneof("constraint") == "choice" and list(back.choice.options) == ["yes", "no"]
    s = back.sampling
    assert s.max_tokens == 64 and s.temperature == 0.5 and s.top_p == 0.75 and s.top_k == 40
    assert s.min_p == 0.125 and s.repetition_penalty == 1.25
    assert s.frequency_penalty == -1.5 and s.presence_penalty == 0.5
    assert s.seed == 2**63 + 7
    assert list(s.stop) == ["\n\n", "END"] and list(s.stop_token_ids) == [2, 32000]
    assert s.include_stop_str_in_output and s.ignore_eos
    assert s.min_tokens == 3 and s.logprobs == 5
    for name in ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed", "logprobs"):
        assert s.HasField(name), name
    assert back.slo.priority == -1 and back.slo.ttft_ms == 250.0
    assert back.stream and back.return_prompt_token_ids and back.request_id == "req-1"


OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "logprobs",
)


@pytest.mark.parametrize("name", OPTIONAL_SAMPLING_FIELDS)
def test_optional_sampling_field_presence(name: str) -> None:
    """Unset is distinguishable from an explicit zero (e.g. temperature 0.0 = greedy), on the wire too."""
    unset = pb.SamplingParameters.FromString(pb.SamplingParameters().SerializeToString())
    assert not unset.HasField(name)
    zero = pb.SamplingParameters(**{name: 0})
    assert zero.HasField(name)
    assert zero.SerializeToString() != b"", "an explicitly set zero must be serialized"
    back = pb.SamplingParameters.FromString(zero.SerializeToString())
    assert back.HasField(name) and getattr(back, name) == 0
    back.ClearField(name)
    assert not back.HasField(name)


def test_plain_scalars_have_no_presence() -> None:
    with pytest.raises(ValueError):
        pb.SamplingParameters().HasField("frequency_penalty")


def test_prompt_oneof() -> None:
    req = pb.GenerateRequest()
    assert req.WhichOneof("prompt") is None
    req.text = "Hello"
    assert req.WhichOneof("prompt") == "text"
    req.token_ids.ids.append(7)
    assert req.WhichOneof("prompt") == "token_ids"
    assert not req.HasField("text") and req.text == ""
    req.text = "again"
    assert req.WhichOneof("prompt") == "text" and not req.HasField("token_ids")
    # An empty TokenIds still selects the token_ids branch, and survives the wire.
    req.token_ids.SetInParent()
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("prompt") == "token_ids" and list(back.token_ids.ids) == []


def test_result_stop_reason_oneof_and_enums() -> None:
    res = pb.GenerateResult(
        request_id="r", finish_reason=pb.FINISH_REASON_STOP, stop_token_id=0, prompt_token_ids=[1, 2]
    )
    back = pb.GenerateResult.FromString(res.SerializeToString())
    assert back.WhichOneof("stop_reason") == "stop_token_id" and back.stop_token_id == 0
    assert back.finish_reason == pb.FINISH_REASON_STOP
    back.stop_string = "###"
    assert back.WhichOneof("stop_reason") == "stop_string"
    assert pb.FinishReason.Name(5) == "FINISH_REASON_ERROR"
    assert pb.WorkerRole.Name(3) == "WORKER_ROLE_COLOCATED"
    assert pb.WorkerHealth.Name(4) == "WORKER_HEALTH_DRAINING"


def test_service_shape() -> None:
    service = pb.DESCRIPTOR.services_by_name["Inference"]
    assert service.full_name == "pdserve.v1.Inference"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Abort", "GetModelInfo", "GetClusterStatus"}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    for name in ("Abort", "GetModelInfo", "GetClusterStatus"):
        assert not methods[name].server_streaming and not methods[name].client_streaming
    assert methods["GetModelInfo"].output_type.name == "ModelInfo"
    assert methods["GetClusterStatus"].output_type.name == "ClusterStatus"
    for attr in ("InferenceStub", "InferenceServicer", "add_InferenceServicer_to_server"):
        assert hasattr(pb_grpc, attr), attr


# --- (c) every declaration in the .proto is documented ------------------------------------------

_FIELD = re.compile(r"^(?:(?:optional|repeated)\s+)?[A-Za-z_][\w.]*\s+(\w+)\s*=\s*\d+\s*;")
_ENUM_VALUE = re.compile(r"^([A-Z][A-Z0-9_]*)\s*=\s*-?\d+\s*;")
_BLOCK = re.compile(r"^(message|enum|service|oneof)\s+(\w+)")
_RPC = re.compile(r"^rpc\s+(\w+)")


def undocumented(text: str) -> tuple[list[str], dict[str, set[str]]]:
    """Return (declarations lacking a comment, field names found per message).

    A declaration is documented when the line just above it is a ``//`` comment or the line
    itself ends with one.
    """
    missing: list[str] = []
    fields: dict[str, set[str]] = {}
    stack: list[tuple[str, str]] = []  # (kind, name) of the enclosing blocks
    previous = ""
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        code = line.split("//", 1)[0].strip()
        documented = previous.startswith("//") or "//" in line
        kind_name: tuple[str, str] | None = None
        if m := _BLOCK.match(code):
            kind_name = (m.group(1), m.group(2))
        elif m := _RPC.match(code):
            kind_name = ("rpc", m.group(1))
        elif stack and stack[-1][0] == "enum" and (m := _ENUM_VALUE.match(code)):
            kind_name = ("enum value", m.group(1))
        elif stack and stack[-1][0] in ("message", "oneof") and (m := _FIELD.match(code)):
            kind_name = ("field", m.group(1))
            message = next(name for kind, name in reversed(stack) if kind == "message")
            fields.setdefault(message, set()).add(m.group(1))
        if kind_name is not None and not documented:
            missing.append(f"line {lineno}: {kind_name[0]} {kind_name[1]}")
        if m := _BLOCK.match(code):
            stack.append((m.group(1), m.group(2)))
            if m.group(1) == "message":
                fields.setdefault(m.group(2), set())
            code = code.partition("{")[2]  # what follows the opening brace, e.g. "}" of "M {}"
        for _ in range(code.count("}")):
            stack.pop()
        previous = line  # a blank line detaches a comment from what follows
    return missing, fields


def test_every_declaration_in_proto_is_documented() -> None:
    missing, fields = undocumented(PROTO_FILE.read_text(encoding="utf-8"))
    assert not missing, "undocumented declarations in inference.proto:\n" + "\n".join(missing)
    # The parser must have seen every field the compiled descriptor has, so that nothing escapes it.
    for name, message in pb.DESCRIPTOR.message_types_by_name.items():
        assert fields.get(name) == {f.name for f in message.fields}, name
    assert set(fields) == set(pb.DESCRIPTOR.message_types_by_name)


def test_documentation_check_catches_gaps() -> None:
    sample = """
// A documented message.
message M {
  // Documented.
  optional int32 a = 1;
  repeated string b = 2;

  uint32 c = 3;  // trailing comment counts
  oneof o {
    // Documented.
    string d = 4;
    TokenIds e = 5;
  }
}
message Empty {}
enum E {
  // Documented.
  E_UNSPECIFIED = 0;

  E_ONE = 1;
}
service S {
  rpc Call(M) returns (stream M);
}
"""
    missing, fields = undocumented(sample)
    assert [entry.split(": ", 1)[1] for entry in missing] == [
        "field b",
        "oneof o",
        "field e",
        "message Empty",
        "enum E",
        "enum value E_ONE",
        "service S",
        "rpc Call",
    ]
    assert fields == {"M": {"a", "b", "c", "d", "e"}, "Empty": set()}
