"""A request's bookkeeping state, shared by every scheduler (pure Python, no torch).

State diagram::

                 add_request
                     |
                     v
    +---------> WAITING ----------------------------+
    |                | scheduled (blocks allocated)  |  abort
    | preempt        v                               v
    | (recompute) PREFILLING --(last chunk)--> DECODING ---> FINISHED_{STOPPED,LENGTH,ABORTED}
    |                |                           |
    +----------------+---------------------------+
                  (blocks freed, num_computed_tokens reset to 0,
                   generated tokens kept and re-prefilled)

On a disaggregated pair the prefill side ends a request in ``PREFILLED`` (its first token sampled,
its KV handed to the transfer layer) and the decode side starts it in ``DECODING``.

Token accounting: ``all_token_ids = prompt + output``. ``num_computed_tokens`` counts tokens
whose KV is in the cache; the next forward pass computes ``all_token_ids[num_computed_tokens:]``.
While decoding, exactly one token (the last sampled one) is not yet computed.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.model_runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREFILLED = "prefilled"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


class FinishReason(enum.Enum):
    """Why generation ended, in OpenAI's vocabulary plus ``stop_string`` / ``abort``."""

    STOP = "stop"  # EOS or a stop token id
    STOP_STRING = "stop_string"
    LENGTH = "length"
    ABORT = "abort"

    @property
    def openai(self) -> str:
        return {"stop_string": "stop", "abort": "abort"}.get(self.value, self.value)


@dataclass(frozen=True)
class Usage:
    """Token counts reported to the client; ``cached_tokens`` came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(eq=False)
class Request:
    """Mutable per-request state owned by exactly one scheduler at a time."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage reporting)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return list(self.prompt_token_ids[start:end])
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return [*self.prompt_token_ids[start:], *self.output_token_ids[: end - n_prompt]]

    def token_block(self, start: int, end: int) -> tuple[int, ...]:
        """``token_slice`` as a tuple: one copy for a block inside the prompt (the prefix
        cache keys, stores and compares whole blocks as tuples)."""
        if end <= len(self.prompt_token_ids):
            return self.prompt_token_ids[start:end]
        return tuple(self.token_slice(start, end))

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_token_stop(self) -> bool:
        """Apply token-level stop rules to the last generated token; set status if finished.

        Order: ``min_tokens`` suppresses EOS/stop ids (the sampler already masks them), then EOS
        (unless ``ignore_eos``), then ``stop_token_ids``, then ``max_tokens``.
        Stop *strings* need detokenized text and are applied by the output processor through
        ``finish(FinishReason.STOP_STRING)``.
        """
        if not self.output_token_ids:
            return False
        last = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.finish(FinishReason.STOP, stop_reason=None)
                return True
            if last in self.params.stop_token_ids:
                self.finish(FinishReason.STOP, stop_reason=last)
                return True
        if n_out >= self.params.max_tokens:
            self.finish(FinishReason.LENGTH)
            return True
        return False

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.status = {
            FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
            FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
        }.get(reason, RequestStatus.FINISHED_STOPPED)
