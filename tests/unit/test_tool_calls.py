"""A tool-call output -> OpenAI's tool_calls: parsing, the whole response, the streamed chunks
(accumulated by the official client as an application would), truncation, and a constrained
output that does not parse (an error, never a call); and the tools shown to the model."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from pdserve.model_runtime.chat_template import ChatTemplateSource
from pdserve.model_runtime.request import Usage
from pdserve.router.chat import ChatTemplate
from pdserve.router.errors import Code, RouterError
from pdserve.router.openai_format import ChoiceBuilder
from pdserve.router.openai_models import ChatCompletionRequest
from pdserve.router.stream import Chunk, Event, Final, Timing
from pdserve.router.structured_api import ToolCallFormat, ToolCallMode
from pdserve.router.tool_calls import ToolCallParseError, parse_tool_calls
from pdserve.router.tool_prompt import chat_messages

NAMED = ToolCallFormat(ToolCallMode.NAMED, "get_weather")
REQUIRED = ToolCallFormat(ToolCallMode.REQUIRED)
CALLS = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "now",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


def final(reason: str) -> Final:
    return Final("r", reason, None, Usage(3, 4, 0), Timing(0, 1, 1, 2), "p", "d", (1, 2, 3), (4, 5), None)


def events(text: str, reason: str, cuts: int = 3) -> list[Event]:
    step = max(1, len(text) // cuts)
    return [*(Chunk((7,), text[i : i + step], None) for i in range(0, len(text), step)), final(reason)]


def whole(fmt: ToolCallFormat, text: str, reason: str) -> dict[str, Any]:
    b = ChoiceBuilder(None, "chatcmpl-1", True, False, "m", 1, fmt)
    for ev in events(text, reason):
        b.add(0, ev)
    choice: dict[str, Any] = b.response()["choices"][0]
    return choice


def streamed(fmt: ToolCallFormat, text: str, reason: str) -> list[dict[str, Any]]:
    b = ChoiceBuilder(None, "chatcmpl-1", True, False, "m", 1, fmt)
    raw = b"data: " + json.dumps(b.role_chunk(0)).encode() + b"\n\n"
    raw += b"".join(b.stream_event(0, ev) for ev in events(text, reason))
    return [json.loads(e.removeprefix("data: ")) for e in raw.decode().split("\n\n") if e]


def accumulated(chunks: list[dict[str, Any]]) -> Any:
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    if chunks[-1]["choices"][0]["finish_reason"] == "length":  # the client's final completion refuses it
        return state.current_completion_snapshot.choices[0]
    return state.get_final_completion().choices[0]


def test_parsing_required_and_named_outputs() -> None:
    calls = parse_tool_calls(CALLS, REQUIRED)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    (call,) = parse_tool_calls('{"city": "Rome"}', NAMED)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Rome"}')
    bad = ["[]", '{"name": "x"}', '[{"name": "x"}]', '[{"name": 1, "arguments": {}}]']
    for text, fmt in [*((b, REQUIRED) for b in bad), ("[1]", NAMED), ('{"a": ', NAMED)]:
        with pytest.raises(ToolCallParseError):
            parse_tool_calls(text, fmt)


def test_a_whole_tool_call_response() -> None:
    choice = whole(REQUIRED, CALLS, "stop")
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["type"] for c in calls] == ["function", "function"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    choice = whole(NAMED, '{"city": "Oslo"}', "stop")
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }


@pytest.mark.parametrize("fmt", [NAMED, REQUIRED])
def test_a_truncated_tool_call_is_its_text_with_length(fmt: ToolCallFormat) -> None:
    choice = whole(fmt, CALLS[:20], "length")
    assert choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": CALLS[:20]}
    assert choice == {**whole(fmt, CALLS[:20], "stop_string"), "finish_reason": "length"}


@pytest.mark.parametrize("fmt", [NAMED, REQUIRED])
def test_a_complete_output_that_does_not_parse_is_an_error_not_a_call(
    fmt: ToolCallFormat, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR), pytest.raises(RouterError) as e:
        whole(fmt, '{"city": ', "stop")
    assert e.value.code is Code.INTERNAL and "does not parse" in caplog.text
    with pytest.raises(RouterError):
        streamed(fmt, '{"city": ', "stop")


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    args = '{"city": "Lisbon"}'
    chunks = streamed(NAMED, args, "stop")
    head = chunks[0]["choices"][0]["delta"]
    assert head["role"] == "assistant" and head["content"] is None
    (announced,) = head["tool_calls"]
    assert announced["index"] == 0 and announced["id"].startswith("call_")
    assert announced["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks[1:-1]]
    assert len(fragments) > 1 and "".join(fragments) == args
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    choice = accumulated(chunks)
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == (announced["id"], "get_weather", args)


def test_required_calls_stream_whole_at_the_end() -> None:
    chunks = streamed(REQUIRED, CALLS, "stop")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 1]  # nothing before the array is whole
    choice = accumulated(chunks)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)


def test_a_truncated_required_stream_sends_its_text() -> None:
    choice = accumulated(streamed(REQUIRED, CALLS[:25], "length"))
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == (
        "length",
        CALLS[:25],
        None,
    )


def body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **fields})


TURNS: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_a_template_without_tools_is_shown_them_as_text() -> None:
    req = body(messages=TURNS, tools=TOOLS)
    messages, tools = chat_messages(req.messages, tuple(req.tools or ()), REQUIRED, native=False)
    assert tools is None and [m.role for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0].content or ""
    assert system.startswith("Be brief.\n\nYou can call these tools")
    assert (
        '{"name": "get_time", "parameters": {"properties": {}, "type": "object"}, "description": "now"}'
        not in system
    )
    assert (
        '{"description": "now", "name": "get_time", "parameters": {"properties": {}, "type": "object"}}'
        in system
    )
    assert messages[2].content == '[{"arguments": {"city": "Paris"}, "name": "get_weather"}]'
    assert messages[3].content == "Result of the call call_1 to get_weather:\nsunny"
    # no system message: one is prepended; the same request renders the same prompt
    again = chat_messages(
        body(messages=TURNS[1:], tools=TOOLS).messages, tuple(req.tools or ()), NAMED, False
    )
    assert again[0][0].role == "system" and again[0][0].content.endswith("a call to get_weather.")  # type: ignore[union-attr]
    assert again == chat_messages(
        body(messages=TURNS[1:], tools=TOOLS).messages, tuple(req.tools or ()), NAMED, False
    )


def test_a_template_that_reads_tools_gets_them_and_the_turns_as_they_came() -> None:
    source = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments }}{% endfor %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}"
    )
    template = ChatTemplate(ChatTemplateSource(source, "test"))
    assert template.uses_tools and not ChatTemplate(None).uses_tools
    req = body(messages=TURNS[1:], tools=TOOLS)
    messages, tools = chat_messages(req.messages, tuple(req.tools or ()), REQUIRED, native=True)
    assert template.render(messages, tools) == (
        "[get_weather][get_time]<user>Weather in Paris?"
        '<assistant>Noneget_weather{"city": "Paris"}<tool>sunny#call_1'
    )
