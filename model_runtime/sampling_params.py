"""Per-request sampling parameters and their validation.

Validation runs once, when the request enters the engine, so the hot loop never sees a bad value;
each failure names the offending field (``InvalidRequestError.field``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.structured.constraint import Constraint, check_constraint

MAX_LOGPROBS_DEFAULT = 20


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: ``low`` (excluded when ``low_open``) to ``high``;
    ``None``: unbounded. One table (``RANGES``) serves the check and the HTTP API's schema."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    integer: bool = False  # whole numbers only
    text: str = ""  # the error's wording, when the interval alone says it badly

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        if self.text:
            return self.text
        if self.high is None:
            return f"must be {'>' if self.low_open else '>='} {self.low:g}"
        return f"must be in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


RANGES = {
    "temperature": Range(0.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, low_open=True),
    "frequency_penalty": Range(-2.0, 2.0),
    "presence_penalty": Range(-2.0, 2.0),
    # int32, as the gRPC API carries it (a larger k keeps every token, as 0 does)
    "top_k": Range(-1, 2**31 - 1, integer=True, text="must be -1, 0 (disabled) or a positive int32"),
    "min_tokens": Range(0, integer=True),
}
# A seed seeds a 64-bit generator: either signedness, as torch takes it (the sampler reads it
# modulo 2**64, so -1 and 2**64 - 1 draw alike), and every value crosses to the workers intact.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
SEED_RANGE = Range(SEED_MIN, SEED_MAX, integer=True, text="must be a 64-bit integer: in [-2**63, 2**64 - 1]")
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
    ``0`` reports only the chosen token's log-probability; a constrained request's are of the
    constrained distribution: the grammar's mask applied to the raw logits).
    ``constraint``: the language the output must belong to (``structured.constraint``).
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
    constraint: Constraint | None = None

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
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if allowed.integer:
                integer(name, value)
            else:
                finite(name, value)
            if value not in allowed:
                raise InvalidRequestError(name, f"{allowed.describe()}, got {value}")
        if self.seed is not None and integer("seed", self.seed) not in SEED_RANGE:
            raise InvalidRequestError("seed", f"{SEED_RANGE.describe()}, got {self.seed}")
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
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise InvalidRequestError("constraint", f"must be a Constraint, got {self.constraint!r}")
            check_constraint(self.constraint)
            # The grammar decides where a constrained output ends: EOS exactly when it accepts.
            for name in ("min_tokens", "ignore_eos"):
                if getattr(self, name):
                    raise InvalidRequestError(name, "cannot be combined with a structured-output constraint")
