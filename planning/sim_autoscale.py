"""``pdserve simulate --autoscale``: the live planner's own code resizing the simulated pools.

Every ``interval_s`` of simulated time the autoscaler measures what the router would (arrivals,
their mean prompt and output lengths and prefix hits; the requests that ended, against the
SLO) over the last interval, asks ``pdserve.planning.planner.Planner`` for a decision and carries
it out as ``pdserve serve --autoscale`` does: a worker moved between the pools is drained and
switched in place (``switch_s``); a new worker holds its GPU from the start and takes requests
``start_s`` later; a retired worker is drained (nothing new routed to it, its requests finish)
and then stopped. Workers still starting count toward the layout, and their start-up is the
warm-up the planner waits out.
"""

from __future__ import annotations

import abc
import bisect
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from pdserve.planning.planner import Planner
from pdserve.planning.planner_data import CHECKS, Decision, Layout, Observation, moves
from pdserve.router.workload_window import Workload, prompt_shape, rank
from pdserve.simulator.cluster import Cluster
from pdserve.simulator.sim_request import SimRequest
from pdserve.simulator.sim_worker import SimWorker
from pdserve.worker.messages import WorkerRole


@dataclass(frozen=True)
class AutoscaleConfig:
    interval_s: float = 30.0
    start_s: float = 20.0  # a new worker's start-up (node, process, weights) before it serves
    switch_s: float = 1.0  # a drained worker's change of role
    checks: int = CHECKS  # looks an interval: the last is the decision, the others may only scale up
    warmup_s: float | None = (
        None  # after a join, windows are a warm-up (the planner holds); None: one interval
    )

    def __post_init__(self) -> None:
        if self.warmup_s is None:
            object.__setattr__(self, "warmup_s", self.interval_s)
        if (
            not (self.interval_s > 0 and self.start_s >= 0 and self.switch_s >= 0 and self.warmup >= 0)
            or self.checks < 1
        ):
            raise ValueError("autoscale interval must be > 0, start-up, switch and warm-up times >= 0")

    @property
    def warmup(self) -> float:
        return self.interval_s if self.warmup_s is None else self.warmup_s


@dataclass
class Timeline:
    decisions: list[Decision] = field(default_factory=list)
    # (t, prefill, decode) after each tick; (t, attainment, requests that ended) of each interval
    layouts: list[tuple[float, int, int]] = field(default_factory=list)
    windows: list[tuple[float, float, int]] = field(default_factory=list)

    def summary(self, interval_s: float, worker_seconds: float) -> dict[str, object]:
        """What ``pdserve simulate --autoscale`` reports of a run."""
        changes = [d for d in self.decisions if d.changes]
        return {
            "interval_s": interval_s,
            "decisions": len(self.decisions),
            "changes": len(changes),
            "worker_seconds": worker_seconds,
            "layouts": self.layouts,
            "attainment_by_interval": self.windows,  # NaN: no request ended in it
            "reasons": [(d.t, d.reason.value, d.layout.prefill, d.layout.decode, d.detail) for d in changes],
        }


R = TypeVar("R")


class PlannerLoop(abc.ABC, Generic[R]):
    """The planner in a simulated cluster (the event simulator's or the fluid model's): a look
    every ``interval_s / checks`` — the interval's last decides, the others may only grow the
    pools — recorded on the timeline, and a decision's layout reached as the live autoscaler
    reaches it: workers switched between the pools first, then started or stopped, and never a
    pool's last serving worker switched (a worker is started in the other pool instead) or
    stopped.

    ``R``: the cluster's role type; ``roles`` is its (prefill, decode)."""

    roles: tuple[R, R]

    def __init__(self, planner: Planner, config: AutoscaleConfig) -> None:
        self.planner = planner
        self.config = config
        self.timeline = Timeline()
        self._looks = 0

    @abc.abstractmethod
    def layout(self) -> Layout:
        """Workers serving or on their way into each pool."""

    @abc.abstractmethod
    def observe(self, now: float, span: float) -> Observation:
        """The window ``(now - span, now]`` as the router would measure it."""

    @abc.abstractmethod
    def arrivals(self, now: float, span: float) -> Workload:
        """The arrivals of ``(now - span, now]``: their rate and mean lengths only (what the
        decode pool's longer window reads, ``LoadMemory.decode_window``)."""

    @abc.abstractmethod
    def serving(self, role: R) -> int:
        """Workers of ``role``'s pool taking requests now."""

    @abc.abstractmethod
    def switch(self, src: R, dst: R) -> None:
        """Drain ``src``'s idlest serving worker and move it into ``dst``."""

    @abc.abstractmethod
    def start(self, role: R) -> None: ...

    @abc.abstractmethod
    def stop(self, role: R) -> None:
        """Drain ``role``'s idlest serving worker and stop it."""

    @abc.abstractmethod
    def worker_seconds(self, until: float) -> float: ...

    def look(self, now: float) -> None:
        cfg = self.config
        self._looks += 1
        full = self._looks % cfg.checks == 0
        span = cfg.interval_s if full else cfg.interval_s / cfg.checks  # a check: shorter, up only
        obs = self.observe(now, span)
        decode = self.planner.memory.decode_window(
            span, cfg.interval_s, now, lambda s: self.arrivals(now, s), now
        )
        obs = replace(obs, decode_load=decode)
        if full:
            ended, attainment = obs.served  # every request, whatever layout it arrived under
            self.timeline.windows.append((now, attainment, ended))
        d = self.planner.decide(obs, up_only=not full)
        if full or d.changes:
            self.timeline.decisions.append(d)
        if d.changes:
            self.apply(d.layout)
        if full:
            lay = self.layout()
            self.timeline.layouts.append((now, lay.prefill, lay.decode))

    def apply(self, target: Layout) -> None:
        switched, grow = moves(self.layout(), target)
        prefill, decode = self.roles
        dst, src = (prefill, decode) if switched > 0 else (decode, prefill)
        need = {prefill: grow[0], decode: grow[1]}
        for _ in range(abs(switched)):
            if self.serving(src) <= 1:  # the last worker of a pool stays: start one instead
                need[dst] += 1
                need[src] -= 1
                continue
            self.switch(src, dst)
        for role, n in need.items():
            for _ in range(n):
                self.start(role)
            for _ in range(-n):
                if self.serving(role) > 1:
                    self.stop(role)

    def summary(self, until: float) -> dict[str, object]:
        return self.timeline.summary(self.config.interval_s, self.worker_seconds(until))


class SimAutoscaler(PlannerLoop[WorkerRole]):
    roles = (WorkerRole.PREFILL, WorkerRole.DECODE)

    def __init__(
        self, cluster: Cluster, planner: Planner, config: AutoscaleConfig, submitted: list[SimRequest]
    ) -> None:
        super().__init__(planner, config)
        self.cluster = cluster
        self.submitted = sorted(submitted, key=lambda sr: sr.arrival)
        self.arrival_times = [sr.arrival for sr in self.submitted]
        self.last_arrival = self.arrival_times[-1] if submitted else 0.0
        self.starting: dict[str, WorkerRole] = {}  # worker id -> the pool it is starting (switching) into
        self.last_join = -math.inf  # the window after a join still holds the backlog it was for
        # when the serving workers last changed (a join, a stop, a switch's leaving): requests
        # that arrived from then on were routed over the present layout alone
        self.layout_since = -math.inf
        cluster.clock.at(config.interval_s / config.checks, self.tick)

    # -- measuring -------------------------------------------------------------------------------
    def layout(self) -> Layout:
        c = self.cluster
        extra = {r: sum(1 for role in self.starting.values() if role is r) for r in WorkerRole}
        return Layout(
            len(c.prefillers) + extra[WorkerRole.PREFILL], len(c.decoders) + extra[WorkerRole.DECODE]
        )

    def _arrived(self, now: float, span: float) -> tuple[list[SimRequest], Workload]:
        """The window's arrivals, and their rate and mean lengths."""
        # every arrival, refused ones too, as the router counts them (``Router.admit``): the
        # load to size for is what is offered, not what the current layout could take
        times = self.arrival_times  # in time order: a window is a slice, not a pass over the run
        arrived = self.submitted[bisect.bisect_right(times, now - span) : bisect.bisect_right(times, now)]
        if not arrived:
            return arrived, Workload(0.0, 0.0, 0.0, span_s=span)
        prompt = statistics.fmean(sr.num_prompt_tokens for sr in arrived)
        output = statistics.fmean(sr.work.params.max_tokens for sr in arrived)
        return arrived, Workload(len(arrived) / span, prompt, output, span_s=span)

    def arrivals(self, now: float, span: float) -> Workload:
        return self._arrived(now, span)[1]

    def observe(self, now: float, span: float) -> Observation:
        c, cfg = self.cluster, self.planner.config
        arrived, base = self._arrived(now, span)
        firsts = [sr for sr in arrived if sr.token_times]
        tokens = sum(sr.num_prompt_tokens for sr in firsts)
        cached = sum(sr.cached for sr in firsts) / tokens if tokens else 0.0
        lo, hi = bisect.bisect_right(c.end_times, now - span), bisect.bisect_right(c.end_times, now)
        # served ones end with their last token, refused ones on arrival; those that arrived
        # before the layout took its present form measure the one they arrived under
        ended = c.finished[lo:hi]
        ttfts, tpots, good, fresh, fresh_good = [], [], 0, 0, 0
        for sr in ended:
            now_layout, met = sr.arrival >= self.layout_since, False
            if not (sr.rejected or sr.error or not sr.token_times):
                t = sr.token_times
                ttft = t[0] - sr.arrival
                tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
                met = ttft <= cfg.ttft_s and tpot <= cfg.tpot_s
                if now_layout:
                    ttfts.append(ttft)
                    tpots.append(tpot)
            good += met
            fresh += now_layout
            fresh_good += now_layout and met
        q = cfg.quantile
        tail, light = prompt_shape([sr.num_prompt_tokens for sr in arrived], q, cfg.shares)
        return Observation(
            t=now,
            layout=self.layout(),
            load=replace(base, cached_share=min(1.0, cached), prompt_tail_tokens=tail, light=light),
            requests=fresh,
            attainment=fresh_good / fresh if fresh else math.nan,
            ttft_s=sorted(ttfts)[rank(len(ttfts), q)] if ttfts else math.nan,
            tpot_s=statistics.median(tpots) if tpots else math.nan,
            warming=bool(self.starting) or now - self.last_join < self.config.warmup,
            ended=(len(ended), good / len(ended) if ended else math.nan),
        )

    # -- acting ----------------------------------------------------------------------------------
    def tick(self) -> None:
        c = self.cluster
        now = c.clock.now
        self.look(now)
        if now < self.last_arrival or c.requests:
            c.clock.at(now + self.config.interval_s / self.config.checks, self.tick)

    def serving(self, role: WorkerRole) -> int:
        return len(self.cluster.pool(role))

    def _idlest(self, role: WorkerRole) -> SimWorker:
        return min(self.cluster.pool(role), key=lambda w: (sum(w.engine.counts()), w.wid))

    def stop(self, role: WorkerRole) -> None:
        self.cluster.retire(self._idlest(role))
        self.layout_since = self.cluster.clock.now

    def worker_seconds(self, until: float) -> float:
        return self.cluster.worker_seconds(until)

    def start(self, role: WorkerRole) -> None:
        w = self.cluster.add_worker(role, ready_in_s=self.config.start_s)
        self.starting[w.wid] = role
        self.cluster.clock.at(self.cluster.clock.now + self.config.start_s, lambda: self._started(w.wid))

    def _started(self, wid: str) -> None:
        """``wid`` joined its pool (started, or switched)."""
        self.starting.pop(wid, None)
        self.last_join = self.layout_since = self.cluster.clock.now

    def switch(self, src: WorkerRole, dst: WorkerRole) -> None:
        w = self._idlest(src)
        self.starting[w.wid] = dst
        self.layout_since = self.cluster.clock.now
        self.cluster.switch(w, dst, self.config.switch_s, on_join=lambda: self._started(w.wid))
