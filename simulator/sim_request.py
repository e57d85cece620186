"""A request in the simulated cluster (``pdserve.simulator.cluster``): what the router knows
of it, and what a client would have measured."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.bench.metrics import RequestResult
from pdserve.router.lifecycle import Attempt
from pdserve.worker.messages import WorkItem

if TYPE_CHECKING:
    from pdserve.simulator.sim_worker import SimWorker


@dataclass
class SimRequest:
    work: WorkItem
    arrival: float
    token_times: list[float] = field(default_factory=list)
    prefill_worker: SimWorker | None = None
    decode_worker: SimWorker | None = None
    attempt: Attempt | None = None  # the current attempt's state machine (the router's)
    cached: int = 0  # prompt tokens a prefix cache served
    done: bool = False
    rejected: bool = False
    error: str = ""  # failed after it was dispatched (the router's answer to the client)
    dispatched: float = 0.0  # when its current attempt was routed
    attempts: int = 0  # times it was routed again (a prompt taken back, or moved off a lost worker)
    fault_migrations: int = 0  # the moves a lost worker caused (bounded as the router bounds them)
    replica: int = 0  # the router replica it landed on (every attempt stays with it)
    # the result once it ended (nothing changes it then): the early stop judges it at its end
    # and the run's summary reads it again, each a list of its inter-token gaps otherwise
    _final: RequestResult | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> str:
        """Its id as first routed (a prompt routed again gets ``id~attempt``): the early
        stop's name for it."""
        return self.work.request_id.split("~", 1)[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.work.prompt_token_ids)

    def result(self) -> RequestResult:
        """What a client measured of this request (tokens' leave times as its arrival times)."""
        if self._final is not None:
            return self._final
        r = self._measured()
        if self.done:
            self._final = r
        return r

    def _measured(self) -> RequestResult:
        t = self.token_times
        if self.rejected:
            return RequestResult(self.num_prompt_tokens, error="RESOURCE_EXHAUSTED: rejected")
        if self.error:
            return RequestResult(self.num_prompt_tokens, error=self.error)
        if not self.done or not t:
            return RequestResult(self.num_prompt_tokens, error="not finished")
        return RequestResult(
            prompt_len=self.num_prompt_tokens,
            success=True,
            output_len=len(t),
            ttft=t[0] - self.arrival,
            itls=[b - a for a, b in itertools.pairwise(t)],
            latency=t[-1] - self.arrival,
        )
