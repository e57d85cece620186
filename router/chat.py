"""Chat messages -> prompt, with the model's own template when it ships one
(``model_runtime/chat_template.py`` says where it is looked for).

Templates run in Jinja2's immutable sandbox (a template comes from a model directory, which
is data, not code). Without one, the documented fallback is::

    {bos}<|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.model_runtime.chat_template import BUILT_IN, ChatTemplateSource
from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.errors import Code, RouterError

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


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
        except TemplateError as e:
            raise ModelLoadError(f"chat template from {self.origin.origin} is invalid: {e}") from None
        self.tokenizer = tokenizer

    @property
    def is_default(self) -> bool:
        """pdserve's built-in template: the checkpoint ships none."""
        return not self.origin.found

    @staticmethod
    def of(tokenizer: TextTokenizer | None) -> ChatTemplate:
        return ChatTemplate(tokenizer.chat if tokenizer else None, tokenizer)

    def prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The rendered prompt as token ids, with nothing added around it: special tokens the
        template writes (BOS included) are its own, as with ``apply_chat_template``."""
        text = self.render(messages)
        if self.tokenizer is None:
            raise RouterError(
                Code.INVALID_ARGUMENT,
                "messages: this model has no tokenizer; use /v1/completions with ids",
                "messages",
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: Sequence[ChatMessage]) -> str:
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
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
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
