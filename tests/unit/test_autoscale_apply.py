"""How ``PoolAutoscaler.apply`` carries out a layout: both pools change side by side (a pool's
new workers are asked for at once, not after the other pool's start-up or drain), a start Ray
cannot place is given up after the bounded wait without holding the other pool, and a failed
start is raised once every change has ended. A fake ``Service`` records when each change
began and ended; no Ray, no router."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdserve.planning.autoscale import PoolAutoscaler
from pdserve.planning.planner_data import Layout
from pdserve.router.membership import PoolChange
from pdserve.worker.messages import WorkerRole


@dataclass
class FakeWorker:
    worker_id: str
    role: WorkerRole
    alive: bool = True
    retiring: bool = False
    routable: bool = True
    inflight: dict[str, Any] = field(default_factory=dict)


class FakeRouter:
    def __init__(self, prefill: int, decode: int) -> None:
        pools = [(WorkerRole.PREFILL, prefill), (WorkerRole.DECODE, decode)]
        self.workers = {
            f"{role.value}-{i}": FakeWorker(f"{role.value}-{i}", role) for role, n in pools for i in range(n)
        }


class FakeService:
    """``resize`` takes ``seconds[role]`` (None: never ends) and fails for ``fail``'s role."""

    def __init__(self, prefill: int, decode: int, seconds: dict[WorkerRole, float | None]) -> None:
        self.router = FakeRouter(prefill, decode)
        self.seconds = seconds
        self.fail: WorkerRole | None = None
        self.began: dict[WorkerRole, float] = {}
        self.ended: dict[WorkerRole, float] = {}
        self.cancelled: set[WorkerRole] = set()
        self.asked: list[int] = []
        self.switches = 0
        self.give_up = ""  # a switch given up with this reason (as the router's drain may)

    def request_capacity(self, workers: int) -> None:
        self.asked.append(workers)

    async def switch_role(self, worker_id: str, role: WorkerRole) -> PoolChange:
        """As ``Membership.switch_role``: done, moving what the worker still held, unless given up."""
        self.switches += 1
        if self.give_up:
            return PoolChange(worker_id, done=False, why_not=self.give_up)
        w = self.router.workers[worker_id]
        moved, w.inflight, w.role = len(w.inflight), {}, role
        return PoolChange(worker_id, done=True, moved=moved)

    async def resize(self, role: WorkerRole, count: int) -> list[PoolChange]:
        self.began[role] = time.monotonic()
        try:
            seconds = self.seconds[role]
            await asyncio.sleep(3600 if seconds is None else seconds)
        except asyncio.CancelledError:
            self.cancelled.add(role)
            raise
        if role is self.fail:
            raise RuntimeError(f"the new {role.value} worker did not start")
        live = [w for w in self.router.workers.values() if w.role is role and not w.retiring]
        for w in live[count:]:
            del self.router.workers[w.worker_id]
        for i in range(len(live), count):
            self.router.workers[f"{role.value}-new-{i}"] = FakeWorker(f"{role.value}-new-{i}", role)
        self.ended[role] = time.monotonic()
        return [PoolChange(w.worker_id, done=True) for w in live[count:]]


def scaler(service: FakeService, grow_wait_s: float = 5.0) -> PoolAutoscaler:
    return PoolAutoscaler(service, planner=None, interval_s=1.0, grow_wait_s=grow_wait_s)  # type: ignore[arg-type]


def test_both_pools_grow_at_once() -> None:
    svc = FakeService(1, 1, {WorkerRole.PREFILL: 0.3, WorkerRole.DECODE: 0.3})
    a = scaler(svc)
    t0 = time.monotonic()
    asyncio.run(a.apply(Layout(3, 2)))
    took = time.monotonic() - t0
    assert a.layout() == Layout(3, 2) and svc.asked == [5]
    # the decode pool's start was asked for before the prefill pool's had ended
    assert svc.began[WorkerRole.DECODE] < svc.ended[WorkerRole.PREFILL]
    assert took < 0.55, took  # one start-up, not two in a row


def test_a_switch_that_moved_requests_is_a_switch() -> None:
    """A worker that switched with its streams moved is switched: the change is not made again
    by retiring and starting workers (which overshot 1P+3D -> 2P+2D to 3P+1D)."""
    svc = FakeService(1, 3, {WorkerRole.PREFILL: 0.05, WorkerRole.DECODE: 0.05})
    for w in svc.router.workers.values():
        if w.role is WorkerRole.DECODE:
            w.inflight = {f"{w.worker_id}-stream": object()}
    a = scaler(svc)
    asyncio.run(a.apply(Layout(2, 2)))
    assert a.layout() == Layout(2, 2) and svc.switches == 1
    assert not svc.began  # nothing retired, nothing started


def test_a_drain_in_one_pool_does_not_hold_the_others_growth() -> None:
    svc = FakeService(3, 1, {WorkerRole.PREFILL: 0.5, WorkerRole.DECODE: 0.05})
    svc.give_up = "no other decode worker takes requests"
    a = scaler(svc)
    asyncio.run(a.apply(Layout(2, 2)))  # the switch is given up: one retired, one started
    assert a.layout() == Layout(2, 2) and svc.switches == 1
    assert svc.ended[WorkerRole.DECODE] < svc.ended[WorkerRole.PREFILL]


def test_a_start_that_cannot_be_placed_is_given_up_without_holding_the_other_pool() -> None:
    svc = FakeService(1, 1, {WorkerRole.PREFILL: None, WorkerRole.DECODE: 0.05})
    a = scaler(svc, grow_wait_s=0.4)
    t0 = time.monotonic()
    asyncio.run(a.apply(Layout(2, 2)))
    assert time.monotonic() - t0 < 0.9
    assert svc.began[WorkerRole.DECODE] - t0 < 0.2  # not after the prefill pool's wait ran out
    assert svc.cancelled == {WorkerRole.PREFILL}
    assert a.layout() == Layout(1, 2)  # the decode pool grew; the prefill start was cancelled


def test_a_failed_start_is_raised_after_the_other_pool_has_grown() -> None:
    svc = FakeService(1, 1, {WorkerRole.PREFILL: 0.05, WorkerRole.DECODE: 0.2})
    svc.fail = WorkerRole.PREFILL
    a = scaler(svc)
    with pytest.raises(RuntimeError, match="prefill worker did not start"):
        asyncio.run(a.apply(Layout(2, 2)))
    assert a.layout() == Layout(1, 2) and WorkerRole.DECODE in svc.ended
