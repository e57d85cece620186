"""Which chat template a checkpoint ships, and the special-token strings it renders with.

Searched in the order ``transformers`` loads them:

1. ``chat_template.jinja`` beside the weights (how ``transformers`` saves templates today; for a
   GGUF it overrides the file's own);
2. ``chat_template.json``'s ``chat_template``;
3. ``tokenizer_config.json``'s ``chat_template``: a string, or a list of named templates of
   which the one named ``default`` is used;
4. a GGUF's ``tokenizer.chat_template``;
5. else the built-in ``DEFAULT_CHAT_TEMPLATE`` (``ChatTemplateSource.found`` is false, and the
   service warns at start-up).

Prompts are rendered to text and tokenized without adding special tokens, as
``apply_chat_template`` does: a template that wants a BOS writes ``{{ bos_token }}`` itself, so
it is never added twice. Pure Python.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A plain, documented chat format for checkpoints that ship none.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ChatTemplateSource:
    template: str
    origin: str  # the file (and key) it came from, or "built-in"
    bos_token: str = ""
    eos_token: str = ""

    @property
    def found(self) -> bool:
        return self.origin != "built-in"


BUILT_IN = ChatTemplateSource(DEFAULT_CHAT_TEMPLATE, "built-in")


def _json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _token_text(value: object) -> str:
    """``tokenizer_config.json`` spells special tokens as strings or as AddedToken objects."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def _pick(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                return template if isinstance(template, str) else None
    return None


def find_chat_template(
    directory: Path, embedded: str | None = None, embedded_origin: str = "", bos: str = "", eos: str = ""
) -> ChatTemplateSource:
    """The template for the checkpoint whose side files are in ``directory``; ``embedded`` is a
    GGUF's own template, ``bos``/``eos`` its special tokens (a ``tokenizer_config.json`` wins)."""
    config = _json(directory / "tokenizer_config.json")
    bos = _token_text(config.get("bos_token")) or bos
    eos = _token_text(config.get("eos_token")) or eos
    jinja = directory / "chat_template.jinja"
    candidates: list[tuple[str | None, str]] = []
    with contextlib.suppress(OSError, UnicodeDecodeError):
        candidates.append((jinja.read_text(), str(jinja)))
    candidates.append(
        (_pick(_json(directory / "chat_template.json").get("chat_template")), "chat_template.json")
    )
    candidates.append((_pick(config.get("chat_template")), str(directory / "tokenizer_config.json")))
    candidates.append((embedded, embedded_origin))
    for template, origin in candidates:
        if template:
            return ChatTemplateSource(template, origin, bos, eos)
    return ChatTemplateSource(DEFAULT_CHAT_TEMPLATE, "built-in", bos, eos)
