"""What a step runner returns, and the protocol every runner meets (pure): the model runner,
the zero and emulated runners, and the simulator's."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling.logprob import Logprob
from pdserve.model_runtime.scheduler.plan import ScheduledChunk


@dataclass
class StepResult:
    sampled: dict[str, int]
    logprobs: dict[str, Logprob]


class Runner(Protocol):
    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        """Compute one step; ``on_layer(i)`` once layer ``i``'s KV is written (layer-wise push)."""
        ...

    def release(self, request_id: str) -> None:
        """Drop whatever the runner keeps for ``request_id`` (it ended)."""
        ...

    def kept_requests(self) -> int:
        """Requests the runner keeps state for (0 once every request was released)."""
        ...
