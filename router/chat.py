"""Chat messages -> prompt text, with the model's own template when it ships one.

Templates run in Jinja2's immutable sandbox (a template comes from a model directory, which
is data, not code). Without one, the documented fallback is::

    <|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.router.errors import Code, RouterError

DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class ChatTemplate:
    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = template or DEFAULT_TEMPLATE
        self.is_default = template is None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token

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
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            msg = f"messages: chat template failed: {e}"
            raise RouterError(Code.INVALID_ARGUMENT, msg, "messages") from e


def _raise(message: str) -> None:
    raise TemplateError(message)
