"""Structured output and tool calls through the HTTP API, driven by the official ``openai``
client in process (the app over a scripted router: no workers, no Ray)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from pdserve.model_runtime.generation_config import NO_DEFAULTS
from pdserve.model_runtime.request import Usage
from pdserve.model_runtime.structured.constraint import Constraint, ConstraintKind
from pdserve.router.chat import ChatTemplate
from pdserve.router.config import Caps
from pdserve.router.openai_api import build_http_app
from pdserve.router.service import GenerateInput
from pdserve.router.slo import SloBook
from pdserve.router.stream import Chunk, Event, Final, Timing

MODEL = "tiny"
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class Bytes:
    """A tokenizer of UTF-8 bytes (what the chat template needs of one)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


class ScriptedRouter:
    """Answers every request with ``reply`` (in three chunks) ending with ``reason``, and keeps
    what it was asked."""

    def __init__(self) -> None:
        self.reply = ""
        self.reason = "stop"
        self.asked: list[GenerateInput] = []
        self.model = SimpleNamespace(model_id=MODEL, vocab_size=256, max_context_length=4096)
        self.config = SimpleNamespace(caps=Caps(), router_id="")
        self.slos = SloBook.of()
        self.tokenizer = None
        self.generation = NO_DEFAULTS
        self.ready = True

    def admit(self, inp: GenerateInput) -> GenerateInput:
        self.asked.append(inp)
        return inp

    def discard(self, _: Any) -> None:
        pass

    async def check_constraint(self, _: Any) -> None:
        pass  # the worker-side compile is tested in tests/unit/test_structured_*.py

    async def run(self, inp: GenerateInput) -> AsyncIterator[Event]:
        third = max(1, len(self.reply) // 3)
        for i in range(0, len(self.reply), third):
            yield Chunk((1,), self.reply[i : i + third], None)
        yield Final(
            inp.request_id, self.reason, None, Usage(5, 3, 0), Timing(0, 1, 1, 2), "p", "d", (1,), (2,), None
        )

    def prompt(self, i: int = -1) -> str:
        return bytes(self.asked[i].prompt).decode()  # type: ignore[arg-type]


@pytest.fixture
def served() -> tuple[ScriptedRouter, openai.OpenAI]:
    router = ScriptedRouter()
    app = build_http_app(router, ChatTemplate(None, Bytes()))  # type: ignore[arg-type]
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="k", http_client=TestClient(app), max_retries=0
    )
    return router, client


class Weather(BaseModel):
    city: str
    celsius: int


def test_parse_sends_the_schema_and_reads_the_answer(served: tuple[ScriptedRouter, openai.OpenAI]) -> None:
    router, client = served
    router.reply = '{"city": "Oslo", "celsius": -3}'
    done = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], response_format=Weather
    )
    assert done.choices[0].message.parsed == Weather(city="Oslo", celsius=-3)
    sent = router.asked[0].params.constraint
    assert sent is not None and sent.kind is ConstraintKind.JSON_SCHEMA
    assert json.loads(sent.spec)["properties"]["celsius"] == {"title": "Celsius", "type": "integer"}


def test_tools_required_answer_with_tool_calls(served: tuple[ScriptedRouter, openai.OpenAI]) -> None:
    router, client = served
    router.reply = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    done = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required"
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the tools were shown to the model (this template has none of its own: a system text)
    assert (
        router.prompt().startswith("<|system|>\nYou can call these tools")
        and '"name": "get_weather"' in router.prompt()
    )
    # the usual tool loop: the call and its result go back, the model answers in text
    router.reply = "It is sunny."
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    done = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none")
    assert done.choices[0].message.content == "It is sunny." and router.asked[-1].params.constraint is None
    assert f"Result of the call {call.id} to get_weather:\nsunny" in router.prompt()
    assert "You can call these tools" not in router.prompt()


def test_a_named_function_streams_its_arguments(served: tuple[ScriptedRouter, openai.OpenAI]) -> None:
    router, client = served
    router.reply = '{"city": "Rome"}'
    with client.beta.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Rome?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ) as stream:
        done = stream.get_final_completion()
    (call,) = done.choices[0].message.tool_calls or []
    assert done.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Rome"}')
    assert router.asked[0].params.constraint == Constraint.json_schema(WEATHER["function"]["parameters"])


def test_refusals_are_400s_naming_the_field(served: tuple[ScriptedRouter, openai.OpenAI]) -> None:
    router, client = served
    user: Any = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, dict[str, Any]]] = [
        ("tool_choice", {"tools": [WEATHER]}),  # "auto"
        (
            "response_format",
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
        ),
        ("guided_regex", {"extra_body": {"guided_regex": ""}}),
        (
            "tools.0.function.name",
            {"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
        ),
    ]
    for param, fields in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=user, **fields)
        assert e.value.status_code == 400 and e.value.param == param, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="p", extra_body={"guided_choice": ["a", "a"]})
    assert e.value.param == "guided_choice"
    assert router.asked == []


def test_completions_take_the_guided_fields(served: tuple[ScriptedRouter, openai.OpenAI]) -> None:
    router, client = served
    router.reply = "yes"
    done = client.completions.create(model=MODEL, prompt="ok?", extra_body={"guided_choice": ["yes", "no"]})
    assert done.choices[0].text == "yes" and router.asked[0].params.constraint == Constraint.choice(
        ["yes", "no"]
    )
