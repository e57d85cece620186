"""The one log-probability record: what the sampler reports for a token, what workers send and
what the front ends render (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
