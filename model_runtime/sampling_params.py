"""Per-request sampling parameters and their validation.

Validation runs once, when the request enters the engine, so the hot loop never sees a bad value;
each failure names the offending field (``InvalidRequestError.field``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.model_runtime.errors import InvalidRequestError

MAX_LOGPROBS_DEFAULT = 20
# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32
# (softmax then yields NaN), and a distribution that sharp is the argmax anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature < GREEDY_TEMPERATURE`` (0 included) means greedy; ``top_k <= 0`` and
    ``top_p == 1`` disable those filters. ``seed`` makes a request's samples depend only on the
    seed and the request's own tokens.
    ``logprobs`` is the number of top alternatives to report per token (``None`` reports none;
    ``0`` reports only the chosen token's log-probability).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @staticmethod
    def create(
        *,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        **kwargs: object,
    ) -> SamplingParams:
        """Build from loosely typed API fields (lists, single strings) into the frozen form."""
        stops: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        return SamplingParams(stop=stops, stop_token_ids=tuple(stop_token_ids or ()), **kwargs)  # type: ignore[arg-type]

    def validate(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS_DEFAULT) -> None:
        """Raise ``InvalidRequestError`` naming the first out-of-range field."""

        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidRequestError(name, f"must be a finite number, got {value!r}")

        def integer(name: str, value: object) -> int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequestError(name, f"must be an integer, got {value!r}")
            return value

        if integer("max_tokens", self.max_tokens) <= 0:
            raise InvalidRequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if integer("top_k", self.top_k) < -1:
            raise InvalidRequestError("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None:
            integer("seed", self.seed)
        if integer("min_tokens", self.min_tokens) < 0:
            raise InvalidRequestError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must not exceed max_tokens ({self.min_tokens} > {self.max_tokens})"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if integer("stop_token_ids", t) < 0 or t >= vocab_size:
                raise InvalidRequestError(
                    "stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab_size})"
                )
        if self.logprobs is not None:
            if integer("logprobs", self.logprobs) < 0:
                raise InvalidRequestError("logprobs", f"must be >= 0, got {self.logprobs}")
            if self.logprobs > max_logprobs:
                raise InvalidRequestError(
                    "logprobs", f"must be <= {max_logprobs} (server cap), got {self.logprobs}"
                )
