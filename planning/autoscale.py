"""``pdserve serve --autoscale``: the pool planner driving a running deployment.

Every interval it reads the router's own windowed measurements — the workload
(``Router.accounting.window``), the SLO tails (``SloTracker.tails``) and the router's
corrections of the step-time model — asks ``pdserve.planning.planner.Planner`` where the pools
should be, and carries it out through ``Service``: a worker moved between the pools is
switched in place (``Service.switch_role``: a drain, well under a second); surplus workers are
retired (drained, what is left migrated, stopped); missing ones started (they take requests
once ready). On a Ray cluster the autoscaler is asked for the target's resources as soon as
the target is known, so nodes start while the workers are being placed. Workers that joined
less than ``warmup_s`` ago make the window a warm-up (the planner holds). Every decision is
logged, counted in the router's metrics and kept for ``/dashboard``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.planning.planner import Planner
from pdserve.planning.planner_data import CHECKS, Decision, Layout, Observation
from pdserve.router.predictor import Phase
from pdserve.worker.messages import WorkerRole

if TYPE_CHECKING:
    from pdserve.deploy.service import Service

log = logging.getLogger(__name__)


class PoolAutoscaler:
    def __init__(
        self,
        service: Service,
        planner: Planner,
        interval_s: float = 30.0,
        warmup_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        checks: int = CHECKS,
        grow_wait_s: float | None = None,
    ) -> None:
        if (
            not interval_s > 0
            or not warmup_s >= 0
            or checks < 1
            or not (grow_wait_s is None or grow_wait_s > 0)
        ):
            raise ValueError(
                "the autoscale interval and start wait must be > 0, the warm-up >= 0 and checks >= 1"
            )
        # How long a change waits for new workers to be placed and ready. A worker Ray cannot
        # place (a cluster at its node limit) must not stop the planner deciding: past this the
        # start is cancelled, and the next decision tries again while Ray's autoscaler keeps the
        # standing request for the nodes (``Service.request_capacity``).
        self.grow_wait_s = max(30.0, 2 * interval_s) if grow_wait_s is None else grow_wait_s
        self.checks = checks  # looks an interval: the last decides, the others may only scale up
        self.service = service
        self.planner = planner
        self.interval_s = interval_s
        self.warmup_s = warmup_s
        self.clock = clock
        self.started = clock()  # the decode pool's window reaches no further back
        self.joined: dict[str, float] = {}  # worker id -> when it joined (or switched role)
        # the layout last seen, and since when (as the looks see it): requests that arrived
        # before then measure the layout they arrived under
        self._seen: tuple[Layout, float] | None = None
        self._task: asyncio.Task[None] | None = None

    # -- measuring -------------------------------------------------------------------------------
    def layout(self) -> Layout:
        router = self.service.router
        assert router is not None
        live = [w for w in router.workers.values() if w.alive and not w.retiring]
        return Layout(
            sum(w.role is WorkerRole.PREFILL for w in live), sum(w.role is WorkerRole.DECODE for w in live)
        )

    def observe(self, span_s: float | None = None) -> Observation:
        router = self.service.router
        assert router is not None
        now = self.clock()
        acc = router.accounting
        q = self.planner.config.quantile
        span = self.interval_s if span_s is None else span_s
        layout = self.layout()
        if self._seen is None or self._seen[0] != layout:
            self._seen = (layout, -math.inf if self._seen is None else now)
        requests, attainment, ttft, tpot = acc.tracker.tails(now, span, q, since=self._seen[1])
        every = acc.tracker.window(now, span)  # whatever layout they arrived under
        load = acc.window.workload(now, span, q, self.planner.config.shares)
        decode = self.planner.memory.decode_window(
            span, self.interval_s, now - self.started, lambda s: acc.window.workload(now, s, q), now
        )
        model = getattr(acc.dispatcher, "model", None)
        factors = (1.0, 1.0)
        if model is not None:  # the router's corrections of the same profile, over all workers
            factors = (model.factor("", Phase.PREFILL), model.factor("", Phase.DECODE))
        first = not self.joined  # the deployment's own workers were there before the planner
        for wid in [w for w in router.workers if w not in self.joined]:
            self.joined[wid] = -math.inf if first else now
        for gone in [w for w in self.joined if w not in router.workers]:
            del self.joined[gone]
        warming = any(now - t < self.warmup_s for t in self.joined.values())
        return Observation(
            t=now,
            layout=layout,
            load=load,
            decode_load=decode,
            requests=requests,
            attainment=attainment,
            ended=(every.requests, every.attainment),
            ttft_s=ttft,
            tpot_s=tpot,
            factors=factors,
            warming=warming,
        )

    # -- acting ----------------------------------------------------------------------------------
    async def tick(self, up_only: bool = False) -> Decision:
        """One look: the interval's decision, or (``up_only``) a check between decisions on a
        shorter window that may only grow the pools."""
        span = self.interval_s / self.checks if up_only else None
        obs = self.observe(span)
        d = self.planner.decide(obs, up_only=up_only)
        c = self.planner.correction
        # what the decision saw, and what it predicts where the pools go: a change's reason is
        # read against these in the log
        seen = (
            f"[{'check' if up_only else 'decision'}: {obs.load.rate:.2f} req/s, attainment "
            f"{obs.attainment:.2f} of {obs.requests}, TTFT {obs.ttft_s * 1e3:.0f} ms / TPOT "
            f"{obs.tpot_s * 1e3:.1f} ms measured; there TTFT {d.predicted.ttft_s * 1e3:.0f} ms / "
            f"TPOT {d.predicted.tpot_s * 1e3:.1f} ms predicted; step-time correction {c}]"
        )
        # a check that changes nothing is noise at INFO; a change is what an operator looks for
        level = logging.WARNING if d.changes else logging.DEBUG if up_only else logging.INFO
        where = "to" if d.changes else "at"
        why = f" ({d.detail})" if d.detail else ""
        log.log(level, "planner: %s %s %dP+%dD%s %s", d.reason.value, where, d.layout.prefill,
                d.layout.decode, why, seen)  # fmt: skip
        if up_only and not d.changes:
            return d
        router = self.service.router
        if router is not None:
            router.accounting.metrics.planned(d.reason.value, d.layout.prefill, d.layout.decode, d.detail)
        if d.changes:
            await self.apply(d.layout)
        return d

    async def apply(self, target: Layout) -> None:
        router = self.service.router
        assert router is not None
        self.service.request_capacity(target.workers)
        have = self.layout()
        need = {
            WorkerRole.PREFILL: target.prefill - have.prefill,
            WorkerRole.DECODE: target.decode - have.decode,
        }
        for src, dst in ((WorkerRole.DECODE, WorkerRole.PREFILL), (WorkerRole.PREFILL, WorkerRole.DECODE)):
            while need[dst] > 0 and need[src] < 0:
                pool = [w for w in router.workers.values() if w.role is src and w.routable]
                if len(pool) <= (0 if src is WorkerRole.PREFILL else 1):
                    break
                w = min(pool, key=lambda h: (len(h.inflight), h.worker_id))
                change = await self.service.switch_role(w.worker_id, dst)
                if not change.done:  # given up (it became the last decode worker): no switch
                    log.warning("planner: %s stays a %s worker: %s", w.worker_id, src.value, change.why_not)
                    break
                self.joined[w.worker_id] = self.clock()
                need[dst] -= 1
                need[src] += 1
        # The pools change side by side: a pool's new workers are asked for at once, never after
        # the other pool's start-up or drain. A failed change is raised once both have ended.
        changes = [self._change(role, n) for role, n in need.items() if n]
        failed = [r for r in await asyncio.gather(*changes, return_exceptions=True) if r is not None]
        if failed:
            raise failed[0]

    async def _change(self, role: WorkerRole, need: int) -> None:
        """Start ``need`` workers in pool ``role`` (< 0: retire as many) and wait for them."""
        router = self.service.router
        assert router is not None
        live = [w for w in router.workers.values() if w.role is role and w.alive and not w.retiring]
        resize = self.service.resize(role, len(live) + need)
        if need < 0:  # retiring: bounded by the drain timeout
            for change in await resize:
                if not change.done:  # the next decision tries again
                    log.warning("planner: %s was not retired: %s", change.worker_id, change.why_not)
            return
        # Each pool its own wait: one that cannot be placed must not starve the other. A start
        # that fails on its own ends the wait with its error (the caller logs it); only the wait
        # running out cancels it.
        growing = asyncio.ensure_future(resize)
        try:
            done, _ = await asyncio.wait({growing}, timeout=self.grow_wait_s)
        except asyncio.CancelledError:
            growing.cancel()
            raise
        if done:
            growing.result()
            return
        growing.cancel()
        await asyncio.gather(growing, return_exceptions=True)  # its clean-up first
        joined = sum(w.role is role and w.alive for w in router.workers.values()) - len(live)
        log.warning(
            "planner: %d of %d new %s worker(s) not placed and ready within %g s; their start was "
            "cancelled, the next decision retries",
            need - max(0, joined),
            need,
            role.value,
            self.grow_wait_s,
        )

    async def run(self) -> None:
        for n in itertools.count(1):
            await asyncio.sleep(self.interval_s / self.checks)
            try:
                await self.tick(up_only=n % self.checks != 0)
            except Exception:  # a failed change is retried by the next interval's decision
                log.exception("planner: the change failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="pool-autoscaler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
