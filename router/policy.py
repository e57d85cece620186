"""Routing: which workers serve a request, and whether to serve it at all (pure Python).

A ``Dispatcher`` sees the request (size, prefix block keys, SLO class) and the workers'
``WorkerLoad`` snapshots, and returns a ``Decision``: a decode worker, and a prefill worker or
``None`` for prefill on the decode worker itself (colocated deployments, and conditional
disaggregation). It never blocks and never does I/O, so it is unit-tested directly and the
simulator drives exactly the same objects. Feedback hooks (first token, end, load report,
prefix-cache events, lost worker) let a dispatcher keep its own account and correct its predictions.

``round_robin`` and ``least_loaded`` pick each pool's worker independently (``PairPolicy``);
``goodput`` (``pdserve.router.goodput``) picks the pair, prefill placement and admission jointly.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.router.slo import SloClass
from pdserve.worker.messages import KvEvents, WorkerLoad


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    request_id: str = ""
    block_keys: tuple[bytes, ...] = ()  # ``pdserve.router.prefix.block_keys`` of the prompt
    slo: SloClass | None = None


class Outcome(enum.Enum):
    REMOTE_PREFILL = "remote_prefill"  # prefill worker computes the KV and ships it to decode
    LOCAL_PREFILL = "local_prefill"  # the decode worker prefills it in its own steps
    BEST_EFFORT = "best_effort"  # no pair meets the SLO; admitted at low priority
    REJECTED = "rejected"  # no pair meets the SLO; refused with a retry hint


BEST_EFFORT_PRIORITY = 1 << 20  # after every normally admitted request (lower is served first)


@dataclass(frozen=True)
class Decision:
    decode_worker: str
    prefill_worker: str | None  # None: the decode worker prefills the request itself
    outcome: Outcome
    reason: str  # why, in a word or two (a metric label)
    predicted_ttft_s: float = math.nan
    predicted_tpot_s: float = math.nan
    retry_after_s: float = 0.0  # REJECTED: when the pair is predicted to have room again
    priority: int = 0  # the priority to run it at (BEST_EFFORT lowers it)


class Dispatcher(Protocol):
    name: str

    def decide(
        self, request: RouteRequest, prefill: Sequence[WorkerLoad], decode: Sequence[WorkerLoad], now: float
    ) -> Decision:
        """Route ``request``; ``decode`` is non-empty and healthy, ``prefill`` may be empty
        (colocated). A REJECTED decision places nothing; any other is placed at once."""
        ...

    def on_report(self, load: WorkerLoad) -> None:
        """A fresh ``WorkerLoad`` arrived."""

    def on_kv_events(self, worker_id: str, events: KvEvents) -> None:
        """The worker's prefix cache changed (its output batch said how)."""

    def on_first_token(self, request_id: str, now: float, ttft_s: float) -> None:
        """The request's first token reached the router (its prefill is done)."""

    def on_end(self, request_id: str, now: float, median_itl_s: float | None) -> None:
        """The request ended (finished, failed or aborted); ``median_itl_s`` if it decoded."""

    def on_worker_lost(self, worker_id: str) -> None:
        """The worker died; forget what was placed on it."""


class RoutingPolicy(Protocol):
    """Picks one worker of one pool (the building block of ``PairPolicy``)."""

    name: str

    def choose(self, candidates: Sequence[WorkerLoad], request: RouteRequest) -> str:
        """The id of one of ``candidates`` (non-empty, all healthy)."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[WorkerLoad], request: RouteRequest) -> str:
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        return ordered[next(self._counter) % len(ordered)].worker_id


class LeastLoaded:
    """Fewest requests in flight (running + waiting), then the most free KV blocks.

    ``pending`` counts requests this router sent since the worker's last load report, so a burst
    does not pile onto one worker between two reports.
    """

    name = "least_loaded"

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}

    def note_sent(self, worker_id: str) -> None:
        self.pending[worker_id] = self.pending.get(worker_id, 0) + 1

    def note_report(self, worker_id: str) -> None:
        self.pending.pop(worker_id, None)

    def choose(self, candidates: Sequence[WorkerLoad], request: RouteRequest) -> str:
        best = min(
            candidates,
            key=lambda w: (w.running + w.waiting + self.pending.get(w.worker_id, 0), -w.kv_free, w.worker_id),
        )
        self.note_sent(best.worker_id)
        return best.worker_id


class PairPolicy:
    """A load-only dispatcher: one ``RoutingPolicy`` per pool, no prediction, no admission."""

    def __init__(self, make: type[RoundRobin] | type[LeastLoaded]) -> None:
        self.name = make.name
        self.prefill, self.decode = make(), make()

    def decide(
        self, request: RouteRequest, prefill: Sequence[WorkerLoad], decode: Sequence[WorkerLoad], now: float
    ) -> Decision:
        d = self.decode.choose(decode, request)
        if not prefill:
            return Decision(d, None, Outcome.LOCAL_PREFILL, "colocated", priority=request.priority)
        p = self.prefill.choose(prefill, request)
        return Decision(d, p, Outcome.REMOTE_PREFILL, "policy", priority=request.priority)

    def on_report(self, load: WorkerLoad) -> None:
        for pol in (self.prefill, self.decode):
            if isinstance(pol, LeastLoaded):
                pol.note_report(load.worker_id)

    def on_kv_events(self, worker_id: str, events: KvEvents) -> None:
        pass  # load-only: prefixes do not weigh

    def on_first_token(self, request_id: str, now: float, ttft_s: float) -> None:
        pass

    def on_end(self, request_id: str, now: float, median_itl_s: float | None) -> None:
        pass

    def on_worker_lost(self, worker_id: str) -> None:
        for pol in (self.prefill, self.decode):
            if isinstance(pol, LeastLoaded):
                pol.note_report(worker_id)


LOAD_POLICIES: dict[str, type[RoundRobin] | type[LeastLoaded]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
}
POLICIES = ("goodput", *LOAD_POLICIES)
