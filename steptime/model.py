"""The step-time protocol and the chunk features every model reads.

A step is a list of chunks ``(new tokens, tokens already cached)``, one per request in the
batch; a decode token is one new token after a cached context.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

Chunks = Sequence[tuple[int, int]]


class StepTimeModel(Protocol):
    """What emulated workers, the simulator and the router need from a step-time model."""

    @property
    def name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int: ...

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One forward pass over ``(new tokens, tokens already cached)`` per request."""
        ...

    def mixed_time(self, chunks: Iterable[tuple[int, int]], decodes: int, decode_context: int) -> float:
        """``step_time`` of ``chunks`` plus ``decodes`` decode tokens whose cached contexts sum
        to ``decode_context``, without a chunk each (a router prices a prompt riding in a
        batch of hundreds of decodes per request and worker)."""
        ...

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float: ...

    def decode_time(self, batch: int, total_context: int) -> float: ...

    def transfer_time(self, tokens: int) -> float: ...

    def to_json(self) -> str: ...


class Wrapper:
    """A model that changes ``base``'s durations and keeps its capacities."""

    base: StepTimeModel

    @property
    def max_model_len(self) -> int:
        return self.base.max_model_len

    @property
    def kv_bytes_per_token(self) -> int:
        return self.base.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> int:
        return self.base.kv_capacity_tokens


def is_decode_chunk(new: int, cached: int) -> bool:
    """A decode token: one new token after a cached context (the convention of every profile)."""
    return new == 1 and cached > 0


def has_prefill(chunks: Iterable[tuple[int, int]]) -> bool:
    """The step computes prompt tokens (a prefill or mixed step), not only decode tokens."""
    return not all(is_decode_chunk(n, c) for n, c in chunks)


def prefill_features(chunks: Iterable[tuple[int, int]]) -> tuple[float, float, float]:
    """``(1, Σl, Σ l·(l + 2c))`` over the prefill chunks (``l`` new tokens after ``c`` cached);
    all zero when the step has none."""
    n = sq = 0.0
    any_chunk = False
    for new, cached in chunks:
        if is_decode_chunk(new, cached) or new <= 0:
            continue
        any_chunk = True
        n += new
        sq += new * (new + 2 * cached)
    return (1.0 if any_chunk else 0.0, n, sq)


def decode_features(chunks: Iterable[tuple[int, int]]) -> tuple[float, float, float]:
    """``(1, Σctx, B)`` over the decode tokens (context = cached + the token itself); all zero
    when the step has none."""
    b = ctx = 0.0
    for new, cached in chunks:
        if is_decode_chunk(new, cached):
            b += 1
            ctx += cached + 1
    return (1.0 if b else 0.0, ctx, b)
