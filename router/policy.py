"""Routing policies: which prefill and which decode worker serve a request (pure Python).

A policy sees only ``WorkerLoad`` snapshots (refreshed with every output batch a worker sends)
and the request's size, and returns a worker id. It never blocks and never does I/O, so it
can be unit-tested directly and reused by the simulator. The goodput-aware policy is another
implementation of the same interface.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from model_runtime.worker.messages import WorkerLoad


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    max_tokens: int
    priority: int = 0


class RoutingPolicy(Protocol):
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


POLICIES: dict[str, type[RoundRobin] | type[LeastLoaded]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}") from None
