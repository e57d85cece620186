"""What a step runner returns, and the protocol every runner meets (pure): the model runner,
the zero and emulated runners, and the simulator's."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling.logprob import Logprob
from pdserve.model_runtime.scheduler.plan import ScheduledChunk


@dataclass
class StepResult:
    sampled: dict[str, int]
    logprobs: dict[str, Logprob]


class StepHandle(Protocol):
    """A launched step. ``result`` waits for its tokens; call it once, before the result of any
    step launched after it."""

    def result(self) -> StepResult: ...


@dataclass
class DoneStep:
    """A step whose result is already on the host."""

    value: StepResult

    def result(self) -> StepResult:
        return self.value


class Runner(Protocol):
    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        """Compute one step; ``on_layer(i)`` once layer ``i``'s KV is written (layer-wise push)."""
        ...

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> StepHandle:
        """Start one step; the caller may plan and launch the next before reading this one's
        ``result``. A ``pending`` chunk's input is the token the step launched just before
        sampled for its request (so steps are launched, and their results read, in order)."""
        ...

    def release(self, request_id: str) -> None:
        """Drop whatever the runner keeps for ``request_id`` (it ended)."""
        ...

    def kept_requests(self) -> int:
        """Requests the runner keeps state for (0 once every request was released)."""
        ...


class PassThroughRunner:
    """A runner that hands every call to ``inner``: a wrapper that watches steps (a counter, a
    benchmark's clock) overrides what it watches and inherits the rest."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner
        self.kv_cache: Any = getattr(inner, "kv_cache", None)

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        return self.inner.execute(chunks, requests, on_layer)

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> StepHandle:
        return self.inner.launch(chunks, requests)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def kept_requests(self) -> int:
        return self.inner.kept_requests()
