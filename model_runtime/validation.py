"""Admission checks every entry point shares: router, offline driver, workers (pure Python).

One function decides whether a request can ever be served, so the router rejects up front
exactly what a worker would reject later; each failure names its field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.kv_cache.manager import blocks_needed
from pdserve.model_runtime.sampling_params import MAX_LOGPROBS_DEFAULT, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a deployment can serve. ``max_prompt_tokens`` / ``max_tokens_cap`` of 0 leave only
    the context and KV-capacity limits; ``kv_capacity_blocks`` is the smallest pool a request
    may be placed on (one request must fit a pool alone)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    kv_capacity_blocks: int
    max_logprobs: int = MAX_LOGPROBS_DEFAULT
    has_tokenizer: bool = True
    max_prompt_tokens: int = 0
    max_tokens_cap: int = 0


class CheckedTokens(tuple[int, ...]):
    """Token ids already checked to be ints in ``[0, vocab)``: immutable, so the check holds
    for as long as the object lives, and ``validate_request`` skips it against any vocabulary
    at least as large. Only ``checked_tokens`` makes one; a message decoded off the wire is a
    plain tuple again, so a worker still checks what another process sends it."""

    vocab: int


def _check_token_ids(prompt_ids: Sequence[int], vocab: int) -> None:
    # in C, not a Python loop a token: this runs for every request on every worker it visits
    if not set(map(type, prompt_ids)) <= {int} or min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        bad = next(t for t in prompt_ids if type(t) is not int or not 0 <= t < vocab)
        raise InvalidRequestError("prompt", f"token id {bad!r} is outside the vocabulary [0, {vocab})")


def checked_tokens(prompt_ids: Sequence[int], vocab: int) -> CheckedTokens:
    """``prompt_ids`` checked once (``InvalidRequestError`` if an id is outside ``[0, vocab)``):
    what a process that hands the same prompt to many engines (a simulator) passes them."""
    if prompt_ids:
        _check_token_ids(prompt_ids, vocab)
    out = CheckedTokens(prompt_ids)
    out.vocab = vocab
    return out


def validate_request(prompt_ids: Sequence[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise ``InvalidRequestError`` for anything this deployment cannot serve."""
    vocab = limits.vocab_size
    if not prompt_ids:
        raise InvalidRequestError("prompt", "must not be empty")
    if not (type(prompt_ids) is CheckedTokens and prompt_ids.vocab <= vocab):
        _check_token_ids(prompt_ids, vocab)
    params.validate(vocab, limits.max_logprobs)
    if limits.max_tokens_cap and params.max_tokens > limits.max_tokens_cap:
        raise InvalidRequestError(
            "max_tokens", f"must be <= {limits.max_tokens_cap} (server cap), got {params.max_tokens}"
        )
    if params.stop and not limits.has_tokenizer:
        raise InvalidRequestError("stop", "stop strings need a tokenizer; use stop_token_ids")
    n = len(prompt_ids)
    if limits.max_prompt_tokens and n > limits.max_prompt_tokens:
        raise InvalidRequestError(
            "prompt", f"{n} tokens exceed the server cap of {limits.max_prompt_tokens} prompt tokens"
        )
    if n >= limits.max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"{n} tokens do not fit the context of {limits.max_model_len} (one is needed to generate)",
        )
    if n + params.max_tokens > limits.max_model_len:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the context of {limits.max_model_len}",
        )
    if blocks_needed(n + params.max_tokens, limits.block_size) > limits.kv_capacity_blocks:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the KV cache "
            f"({limits.kv_capacity_blocks * limits.block_size} tokens)",
        )
