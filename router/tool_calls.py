"""A tool-call request's output -> OpenAI's ``tool_calls``, whole and streamed (pure).

The output was constrained (``router/structured_api.py``): a named function's is its arguments,
"required"'s a JSON array of ``{"name", "arguments"}``. An output the engine ended ("stop")
that does not parse anyway is a server bug: it is logged and answered with an error, never
passed on as a call. A truncated output ("length") cannot be a call: its text is the content.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.errors import Code, RouterError
from pdserve.router.structured_api import ToolCallFormat, ToolCallMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    def json(self, index: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {} if index is None else {"index": index}
        body.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return body


class ToolCallParseError(ValueError):
    """A constrained output that is not the calls its constraint promised."""


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(text: str, fmt: ToolCallFormat, ids: list[str] | None = None) -> list[ToolCall]:
    """The calls in an output; ``ids``: the calls' ids when some are already known (a stream's)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ToolCallParseError(f"the output is not JSON: {e}") from None
    ids = list(ids or ())
    if fmt.mode is ToolCallMode.NAMED:
        if not isinstance(value, dict):
            raise ToolCallParseError("the arguments are not a JSON object")
        return [ToolCall(ids[0] if ids else new_call_id(), fmt.name, text)]
    if not isinstance(value, list) or not value:
        raise ToolCallParseError("the output is not a non-empty JSON array of calls")
    calls = []
    for i, item in enumerate(value):
        if not (
            isinstance(item, dict)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("arguments"), dict)
        ):
            raise ToolCallParseError(f"call {i} is not an object with a name and an arguments object")
        args = json.dumps(item["arguments"], ensure_ascii=False)
        calls.append(ToolCall(ids[i] if i < len(ids) else new_call_id(), item["name"], args))
    return calls


def _bug(fmt: ToolCallFormat, request_id: str, e: ToolCallParseError) -> RouterError:
    log.error("request %s: a %s tool-call output does not parse: %s", request_id, fmt.mode.value, e)
    return RouterError(
        Code.INTERNAL, "the model's tool-call output does not parse (a server bug; see its log)"
    )


def tool_message(
    text: str, finish_reason: str, complete: bool, fmt: ToolCallFormat, request_id: str
) -> tuple[dict[str, Any], str]:
    """A whole response's ``message`` and ``finish_reason`` (``finish_reason``: the API's;
    ``complete``: the engine ended the output itself, "stop", so the constraint is met)."""
    if complete:
        try:
            calls = parse_tool_calls(text, fmt)
        except ToolCallParseError as e:
            raise _bug(fmt, request_id, e) from None
        return {"role": "assistant", "content": None, "tool_calls": [c.json() for c in calls]}, "tool_calls"
    return {"role": "assistant", "content": text}, finish_reason


@dataclass
class ToolCallStream:
    """One choice's streamed tool calls: ``head`` is the first delta; ``text`` the delta for new
    output text (``None``: nothing to send yet); ``end`` the last deltas and the finish reason.

    A named function's arguments stream as they arrive, under a call announced in the first
    delta. "required"'s array can be split into calls only when whole: each call is sent
    complete, in one delta, at the end."""

    fmt: ToolCallFormat
    request_id: str
    _text: list[str] = field(default_factory=list)
    _id: str = field(default_factory=new_call_id)

    def head(self) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": None}
        if self.fmt.mode is ToolCallMode.NAMED:
            delta["tool_calls"] = [ToolCall(self._id, self.fmt.name, "").json(0)]
        return delta

    def text(self, text: str) -> dict[str, Any] | None:
        self._text.append(text)
        if self.fmt.mode is ToolCallMode.NAMED and text:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        return None

    def end(self, finish_reason: str, complete: bool) -> tuple[list[dict[str, Any]], str]:
        text = "".join(self._text)
        if not complete:
            if self.fmt.mode is ToolCallMode.REQUIRED and text:
                return [{"content": text}], finish_reason
            return [], finish_reason
        try:
            calls = parse_tool_calls(text, self.fmt, [self._id])
        except ToolCallParseError as e:
            raise _bug(self.fmt, self.request_id, e) from None
        if self.fmt.mode is ToolCallMode.NAMED:
            return [], "tool_calls"
        return [{"tool_calls": [c.json(i)]} for i, c in enumerate(calls)], "tool_calls"
