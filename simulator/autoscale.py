"""``pdserve simulate --autoscale``: the live planner's own code resizing the simulated pools.

Every ``interval_s`` of simulated time the autoscaler measures what the router would (arrivals,
their mean prompt and output lengths and prefix hits; the requests that ended, against the
SLO) over the last interval, asks ``pdserve.deploy.planner.Planner`` for a decision and carries
it out as ``pdserve serve --autoscale`` does: a worker moved between the pools is drained and
switched in place (``switch_s``); a new worker holds its GPU from the start and takes requests
``start_s`` later; a retired worker is drained (nothing new routed to it, its requests finish)
and then stopped. Workers still starting count toward the layout, and their start-up is the
warm-up the planner waits out.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field

from pdserve.deploy.planner import Decision, Layout, Observation, Planner, moves
from pdserve.router.workload_window import Workload, prompt_quantile
from pdserve.simulator.cluster import Cluster, SimRequest, SimWorker
from pdserve.worker.messages import WorkerRole


@dataclass(frozen=True)
class AutoscaleConfig:
    interval_s: float = 30.0
    start_s: float = 20.0  # a new worker's start-up (node, process, weights) before it serves
    switch_s: float = 1.0  # a drained worker's change of role
    checks: int = 3  # looks an interval: the last is the decision, the others may only scale up
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


class SimAutoscaler:
    def __init__(
        self, cluster: Cluster, planner: Planner, config: AutoscaleConfig, submitted: list[SimRequest]
    ) -> None:
        self.cluster = cluster
        self.planner = planner
        self.config = config
        self.submitted = sorted(submitted, key=lambda sr: sr.arrival)
        self.arrivals = [sr.arrival for sr in self.submitted]
        self.last_arrival = self.arrivals[-1] if submitted else 0.0
        self.starting: dict[str, WorkerRole] = {}  # worker id -> the pool it is starting (switching) into
        self.last_join = -math.inf  # the window after a join still holds the backlog it was for
        self.timeline = Timeline()
        self._ticks = 0
        cluster.clock.at(config.interval_s / config.checks, self.tick)

    # -- measuring -------------------------------------------------------------------------------
    def layout(self) -> Layout:
        c = self.cluster
        extra = {r: sum(1 for role in self.starting.values() if role is r) for r in WorkerRole}
        return Layout(
            len(c.prefillers) + extra[WorkerRole.PREFILL], len(c.decoders) + extra[WorkerRole.DECODE]
        )

    def observe(self, now: float, span: float | None = None) -> Observation:
        span = self.config.interval_s if span is None else span
        c, cfg = self.cluster, self.planner.config
        # both lists are in time order: each window is a slice (a look is not a pass over the run)
        # every arrival, refused ones too, as the router counts them (``Router.admit``): the
        # load to size for is what is offered, not what the current layout could take
        arrived = self.submitted[
            bisect.bisect_right(self.arrivals, now - span) : bisect.bisect_right(self.arrivals, now)
        ]
        prompt = statistics.fmean(sr.num_prompt_tokens for sr in arrived) if arrived else 0.0
        output = statistics.fmean(sr.work.params.max_tokens for sr in arrived) if arrived else 0.0
        firsts = [sr for sr in arrived if sr.token_times]
        tokens = sum(sr.num_prompt_tokens for sr in firsts)
        cached = sum(sr.cached for sr in firsts) / tokens if tokens else 0.0
        lo, hi = bisect.bisect_right(c.end_times, now - span), bisect.bisect_right(c.end_times, now)
        ended = c.finished[lo:hi]  # served ones end with their last token, refused ones on arrival
        ttfts, tpots, good = [], [], 0
        for sr in ended:
            if sr.rejected or sr.error or not sr.token_times:
                continue
            t = sr.token_times
            ttft = t[0] - sr.arrival
            tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
            ttfts.append(ttft)
            tpots.append(tpot)
            good += ttft <= cfg.ttft_s and tpot <= cfg.tpot_s
        q = cfg.quantile
        tail = prompt_quantile([sr.num_prompt_tokens for sr in arrived], q)
        return Observation(
            t=now,
            layout=self.layout(),
            load=Workload(len(arrived) / span, prompt, output, min(1.0, cached), tail),
            requests=len(ended),
            attainment=good / len(ended) if ended else math.nan,
            ttft_s=sorted(ttfts)[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else math.nan,
            tpot_s=statistics.median(tpots) if tpots else math.nan,
            warming=bool(self.starting) or now - self.last_join < self.config.warmup,
        )

    # -- acting ----------------------------------------------------------------------------------
    def tick(self) -> None:
        c, cfg = self.cluster, self.config
        now = c.clock.now
        self._ticks += 1
        full = self._ticks % cfg.checks == 0
        if full:
            obs = self.observe(now)
            self.timeline.windows.append((now, obs.attainment, obs.requests))
            d = self.planner.decide(obs)
        else:  # between decisions: a shorter window, up only
            d = self.planner.decide(self.observe(now, cfg.interval_s / cfg.checks), up_only=True)
        if full or d.changes:
            self.timeline.decisions.append(d)
        if d.changes:
            self.apply(d.layout)
        if full:
            lay = self.layout()
            self.timeline.layouts.append((now, lay.prefill, lay.decode))
        if now < self.last_arrival or c.requests:
            c.clock.at(now + cfg.interval_s / cfg.checks, self.tick)

    def apply(self, target: Layout) -> None:
        switched, grow = moves(self.layout(), target)
        src, dst = (
            (WorkerRole.DECODE, WorkerRole.PREFILL)
            if switched > 0
            else (WorkerRole.PREFILL, WorkerRole.DECODE)
        )
        need = dict(zip((WorkerRole.PREFILL, WorkerRole.DECODE), grow, strict=True))
        for _ in range(abs(switched)):
            if len(self.cluster.pool(src)) <= 1:  # the last worker of a pool stays: start one instead
                need[dst] += 1
                need[src] -= 1
                continue
            self._switch(self._idlest(src), dst)
        for role, n in need.items():
            for _ in range(n):
                self._start(role)
            for _ in range(-n):
                if len(self.cluster.pool(role)) > 1:
                    self.cluster.retire(self._idlest(role))

    def _idlest(self, role: WorkerRole) -> SimWorker:
        return min(self.cluster.pool(role), key=lambda w: (sum(w.engine.counts()), w.wid))

    def _start(self, role: WorkerRole) -> None:
        w = self.cluster.add_worker(role, ready_in_s=self.config.start_s)
        self.starting[w.wid] = role
        self.cluster.clock.at(self.cluster.clock.now + self.config.start_s, lambda: self._started(w.wid))

    def _started(self, wid: str) -> None:
        """``wid`` joined its pool (started, or switched)."""
        self.starting.pop(wid, None)
        self.last_join = self.cluster.clock.now

    def _switch(self, w: SimWorker, role: WorkerRole) -> None:
        self.starting[w.wid] = role
        self.cluster.switch(w, role, self.config.switch_s, on_join=lambda: self._started(w.wid))

    def summary(self, until: float) -> dict[str, object]:
        return self.timeline.summary(self.config.interval_s, self.cluster.worker_seconds(until))
