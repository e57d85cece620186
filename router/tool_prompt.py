"""Chat messages with tools -> what the chat template renders (pure).

A template that reads ``tools`` gets them, and earlier turns' ``tool_calls`` and ``tool`` results,
as the OpenAI API carries them (the Hugging Face convention). Any other template is shown the
tools as a system text (merged into the first system message, or prepended as one) and earlier
calls and results as text in roles it knows: an assistant's calls as the JSON array a
"required" answer is, a tool's result as a user turn naming the call. The text is the same for
the same request (keys sorted), so equal prompts share cached blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdserve.router.chat import ChatMessage, ToolCallRef
from pdserve.router.openai_models import Message, Tool
from pdserve.router.structured_api import ToolCallFormat, ToolCallMode, parameters_of

SYSTEM_ROLES = ("system", "developer")


def chat_messages(
    messages: Sequence[Message], tools: Sequence[Tool], fmt: ToolCallFormat | None, native: bool
) -> tuple[list[ChatMessage], list[dict[str, Any]] | None]:
    """The template's messages, and its ``tools`` (``None``: none to pass); ``native``: the
    template reads ``tools``."""
    if native:
        turns = [
            ChatMessage(
                m.role,
                None if m.content is None and m.tool_calls else m.text(),
                tuple(ToolCallRef(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ()),
                m.tool_call_id,
            )
            for m in messages
        ]
        return turns, [t.model_dump(by_alias=True, exclude_none=True) for t in tools] or None
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    turns = [_as_text(m, names) for m in messages]
    if tools:
        listing = tools_text(tools, fmt)
        if turns[0].role in SYSTEM_ROLES:
            turns[0] = ChatMessage(turns[0].role, f"{turns[0].content}\n\n{listing}")
        else:
            turns.insert(0, ChatMessage("system", listing))
    return turns, None


def tools_text(tools: Sequence[Tool], fmt: ToolCallFormat | None) -> str:
    lines = ["You can call these tools (one JSON object each):"]
    for i, t in enumerate(tools):
        entry: dict[str, Any] = {"name": t.function.name}
        if t.function.description:
            entry["description"] = t.function.description
        entry["parameters"] = parameters_of(t, i)
        lines.append(json.dumps(entry, ensure_ascii=False, sort_keys=True))
    if fmt is not None and fmt.mode is ToolCallMode.NAMED:
        lines.append(f"Answer with the JSON arguments of a call to {fmt.name}.")
    else:
        lines.append('Answer with a JSON array of calls: [{"name": <tool name>, "arguments": {...}}].')
    return "\n".join(lines)


def _as_text(m: Message, names: dict[str, str]) -> ChatMessage:
    text = m.text()
    if m.tool_calls:
        calls = [
            {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)} for c in m.tool_calls
        ]
        listed = json.dumps(calls, ensure_ascii=False, sort_keys=True)
        return ChatMessage(m.role, f"{text}\n{listed}" if text else listed)
    if m.role == "tool":
        call = m.tool_call_id or "?"
        return ChatMessage(
            "user", f"Result of the call {call} to {names.get(call, m.name or 'a tool')}:\n{text}"
        )
    return ChatMessage(m.role, text)


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
