"""Chat messages -> prompt, with the model's own template when it ships one
(``model_runtime/chat_template.py`` says where it is looked for).

Templates run in Jinja2's immutable sandbox (a template comes from a model directory, which
is data, not code). Without one, the documented fallback is::

    {bos}<|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.model_runtime.chat_template import BUILT_IN, ChatTemplateSource
from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.errors import Code, RouterError

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCallRef:
    """A call an assistant turn made, as the OpenAI API carries it."""

    id: str
    name: str
    arguments: str  # JSON text

    def json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ChatMessage:
    """One turn; ``tool_calls`` and ``tool_call_id`` go to templates that render tools."""

    role: str
    content: str | None
    tool_calls: tuple[ToolCallRef, ...] = ()
    tool_call_id: str | None = None

    def json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            body["tool_calls"] = [c.json() for c in self.tool_calls]
        if self.tool_call_id is not None:
            body["tool_call_id"] = self.tool_call_id
        return body


class ChatTemplate:
    def __init__(self, source: ChatTemplateSource | None, tokenizer: TextTokenizer | None = None) -> None:
        self.origin = source or BUILT_IN
        # The environment transformers renders chat templates in: loop controls, its tojson
        # (no HTML escaping), strftime_now, raise_exception.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.origin.template)
            variables = meta.find_undeclared_variables(env.parse(self.origin.template))
        except TemplateError as e:
            raise ModelLoadError(f"chat template from {self.origin.origin} is invalid: {e}") from None
        # A template that reads ``tools`` renders them (and, as its model was trained, the
        # calls and results of earlier turns); others are shown tools as text.
        self.uses_tools = "tools" in variables
        self.tokenizer = tokenizer

    @property
    def is_default(self) -> bool:
        """pdserve's built-in template: the checkpoint ships none."""
        return not self.origin.found

    @staticmethod
    def of(tokenizer: TextTokenizer | None) -> ChatTemplate:
        return ChatTemplate(tokenizer.chat if tokenizer else None, tokenizer)

    def prompt_ids(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The rendered prompt as token ids, with nothing added around it: special tokens the
        template writes (BOS included) are its own, as with ``apply_chat_template``."""
        text = self.render(messages, tools)
        if self.tokenizer is None:
            raise RouterError(
                Code.INVALID_ARGUMENT,
                "messages: this model has no tokenizer; use /v1/completions with ids",
                "messages",
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        if not messages:
            raise RouterError(Code.INVALID_ARGUMENT, "messages: must not be empty", "messages")
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise RouterError(
                    Code.INVALID_ARGUMENT,
                    f"messages[{i}].role: must be one of {', '.join(ROLES)}, got {m.role!r}",
                    "messages",
                )
        try:
            extra = {"tools": list(tools)} if tools else {}
            return self._template.render(
                messages=[m.json() for m in messages],
                add_generation_prompt=True,
                **extra,
                bos_token=self.origin.bos_token,
                eos_token=self.origin.eos_token,
            )
        except TemplateError as e:
            msg = f"messages: chat template failed: {e}"
            raise RouterError(Code.INVALID_ARGUMENT, msg, "messages") from e


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _raise(message: str) -> None:
    raise TemplateError(message)
