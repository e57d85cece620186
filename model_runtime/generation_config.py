"""What a checkpoint says about generating with it: its end-of-sequence ids and the sampling
values its authors recommend (``generation_config.json``, or a GGUF's ``general.sampling.*``).

Precedence, for every sampling field: the request's own value, else the checkpoint's
(``GenerationDefaults``), else pdserve's (``SamplingParams``' defaults, the OpenAI API's).
``max_tokens`` likewise: the request's, else the checkpoint's ``max_new_tokens``, else the
server's ``--default-max-tokens``; the server's cap bounds the last two. A checkpoint value a
request could not set (``top_p: 0``, ``max_new_tokens: 0``, NaN) is dropped. As in vLLM, the values are
taken whatever ``do_sample`` says. Pure Python.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# generation_config.json key -> request field.
_HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF metadata key -> request field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_GGUF_EOS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
GGUF_KEYS = (*_GGUF_EOS, *_GGUF_KEYS)  # every GGUF metadata key ``gguf_generation_config`` reads
_INTEGERS = ("top_k", "max_tokens")
# What a request could set itself; a checkpoint's value outside is dropped, not applied.
_VALID = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= -1,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: v > 0,
    "max_tokens": lambda v: v >= 1,
}


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling values a checkpoint recommends; ``None``: it says nothing."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @staticmethod
    def of(values: Mapping[str, Any], names: Mapping[str, str]) -> GenerationDefaults:
        """Pick ``names`` out of ``values``; a value of the wrong type or not finite is dropped
        (a checkpoint's advice never makes requests fail)."""
        picked: dict[str, Any] = {}
        for key, name in names.items():
            v = values.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            if name in _INTEGERS:
                if float(v) != int(v):
                    continue
                v = int(v)
            if _VALID[name](v):
                picked[name] = v
        return GenerationDefaults(**picked)

    def given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def fill(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """``request`` with every field it leaves unset (absent or ``None``) taken from here."""
        out = {k: v for k, v in request.items() if v is not None}
        for name, value in self.given().items():
            out.setdefault(name, value)
        return out


NO_DEFAULTS = GenerationDefaults()


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    defaults: GenerationDefaults = NO_DEFAULTS
    source: str = ""  # where it was read from; "" when the checkpoint has none


def _ids(value: object) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    return tuple(i for i in items if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def read_generation_config(directory: Path) -> GenerationConfig:
    """``generation_config.json`` in ``directory``; an absent or unreadable file says nothing."""
    path = directory / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return GenerationConfig()
    if not isinstance(raw, dict):
        return GenerationConfig()
    return GenerationConfig(_ids(raw.get("eos_token_id")), GenerationDefaults.of(raw, _HF_KEYS), str(path))


# Control tokens that end a turn whatever the file's EOS id says (older Llama 3 Instruct files
# name <|end_of_text|> their EOS and nothing else); llama.cpp stops at these too.
END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<end_of_turn>")


def gguf_generation_config(
    metadata: Mapping[str, Any], source: str, control: Mapping[int, str] | None = None
) -> GenerationConfig:
    """A GGUF's end-of-generation ids (EOS, end-of-turn, end-of-message, and those of its
    ``control`` tokens, by id, that are in ``END_OF_GENERATION``) and sampling values."""
    eos: list[int] = []
    for key in _GGUF_EOS:
        eos.extend(i for i in _ids(metadata.get(key)) if i not in eos)
    ends = set(END_OF_GENERATION)
    eos.extend(i for i, t in (control or {}).items() if t in ends and i not in eos)
    return GenerationConfig(tuple(eos), GenerationDefaults.of(metadata, _GGUF_KEYS), source)


def merged(first: GenerationConfig, second: GenerationConfig) -> GenerationConfig:
    """EOS ids of both; ``first``'s sampling values win."""
    eos = tuple(dict.fromkeys(first.eos_token_ids + second.eos_token_ids))
    defaults = GenerationDefaults(**second.defaults.fill(first.defaults.given()))
    return GenerationConfig(eos, defaults, first.source or second.source)
