"""``pdserve simulate --fluid``: a workload through the request-level model
(``pdserve.planning.fluid``), with the live planner's code resizing the pools (``--autoscale``).

Arrivals are made in chunks as the run needs them (a day at 64 GPUs is tens of millions of
requests): a trace replay is ``pdserve bench``'s own — the same rows, lap after lap, at the
mean rate, warped along ``--rate-curve`` — computed on arrays; the other datasets are built
whole by ``pdserve.simulator.run.workload``. The autoscaler measures, decides and acts as
``pdserve.planning.sim_autoscale.SimAutoscaler`` does on the event simulator (the same planner,
checks, start-up, switch and warm-up), on the model's ticks.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.metrics import Slo
from pdserve.bench.workload import RateCurve, RequestSpec, WorkloadError, num_prompts, rate_curve, read_trace
from pdserve.planning.fluid import FluidCluster
from pdserve.planning.fluid_data import Arrivals, Ended, FluidConfig, Role, ticks
from pdserve.planning.planner import Planner
from pdserve.planning.planner_data import Layout, Observation
from pdserve.planning.settings import planner_settings
from pdserve.planning.sim_autoscale import AutoscaleConfig, PlannerLoop
from pdserve.router.workload_window import Workload, kept, rank
from pdserve.simulator.calibration import load_sim_profile

CHUNK = 200_000  # arrivals made at a time
DRAIN_S = 3600.0
HOUR = 3600.0


class Hourly:
    """What each hour of a run cost and met: the requests that arrived in it, the share of
    them that met the SLO (whenever they ended), and the worker-hours held in it. A day's
    attainment is an average over hours of loads 5x apart: where a layout misses (the peak, or
    every hour alike) is what tells a planner from a static layout at the same average."""

    def __init__(self) -> None:
        self.requests = np.zeros(0)
        self.good = np.zeros(0)
        self.held: list[float] = [0.0]  # worker-seconds held by each hour's end, from the start

    def _grow(self, hours: int) -> None:
        if hours > len(self.requests):
            more = hours - len(self.requests)
            self.requests = np.concatenate([self.requests, np.zeros(more)])
            self.good = np.concatenate([self.good, np.zeros(more)])

    def ended(self, ended: list[Ended]) -> None:
        for e in ended:
            if len(e.arrival):
                hour = (e.arrival // HOUR).astype(np.int64)
                self._grow(int(hour.max()) + 1)
                np.add.at(self.requests, hour, 1.0)
                np.add.at(self.good, hour, e.good.astype(np.float64))

    def tick(self, now: float, cluster: FluidCluster) -> None:
        """Close the hours ``now`` has passed (called after each tick)."""
        while now >= len(self.held) * HOUR:
            self.held.append(cluster.worker_seconds(len(self.held) * HOUR))

    def rows(self, end: float, cluster: FluidCluster) -> list[dict[str, float | None]]:
        """One row an hour up to ``end`` (attainment None for an hour nothing arrived in)."""
        marks = [*self.held, cluster.worker_seconds(end)]  # by each closed hour's end, then by ``end``
        hours = max(len(self.requests), math.ceil(end / HOUR))
        self._grow(hours)
        at = [marks[min(h, len(marks) - 1)] for h in range(hours + 1)]
        return [
            {
                "hour": h,
                "requests": int(self.requests[h]),
                "attainment": round(float(self.good[h] / self.requests[h]), 4) if self.requests[h] else None,
                "worker_hours": round((at[h + 1] - at[h]) / HOUR, 2),
            }
            for h in range(hours)
        ]


def warp(curve: RateCurve, tau: np.ndarray) -> np.ndarray:
    """``RateCurve.warp`` of every element (the same arithmetic, on arrays)."""
    pts = curve.points
    t0 = np.array([p[0] for p in pts[:-1]])
    t1 = np.array([p[0] for p in pts[1:]])
    x0 = np.array([p[1] for p in pts[:-1]])
    x1 = np.array([p[1] for p in pts[1:]])
    areas = (t1 - t0) * (x0 + x1) / 2
    done = np.concatenate(([0.0], np.cumsum(areas)))
    seg = np.searchsorted(done[1:], tau, side="left")  # the first segment whose end reaches tau
    out = np.empty_like(tau)
    tail = seg >= len(areas)
    out[tail] = pts[-1][0] + (tau[tail] - done[-1]) / pts[-1][1]
    i = seg[~tail]
    if len(i):
        h, a, b = t1[i] - t0[i], x0[i], x1[i]
        need, k = tau[~tail] - done[i], (b - a) / (2 * h)
        flat = np.abs(k) < 1e-15
        safe_k = np.where(flat, 1.0, k)
        u = np.where(
            flat, need / a, (-a + np.sqrt(np.maximum(0.0, a * a + 4 * safe_k * need))) / (2 * safe_k)
        )
        out[~tail] = t0[i] + np.minimum(h, np.maximum(0.0, u))
    return out


def trace_arrivals(
    path: Path, rate: float, n: int, start: int = 0, curve: RateCurve | None = None
) -> Iterator[Arrivals]:
    """The first ``n`` requests of the trace replay ``pdserve bench`` makes at mean ``rate``
    (``loop_trace`` laps, the trace's own pattern scaled to the rate, then ``curve``), in
    chunks."""
    rows = read_trace(path)
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    if not 0 <= start < len(rows):
        raise WorkloadError(f"--trace-start {start} is outside the trace's {len(rows)} rows")
    ts = np.array([r.timestamp_s for r in rows])
    ins = np.array([r.input_len for r in rows], dtype=np.int64)
    outs = np.array([r.output_len for r in rows], dtype=np.int64)
    span = ts[-1] - ts[0]
    period = span + (span / (len(rows) - 1) if len(rows) > 1 else 1.0)

    def stamp(i: np.ndarray) -> np.ndarray:
        lap, r = np.divmod(i, len(rows))
        out: np.ndarray = ts[r] + lap * period
        return out

    ends = stamp(np.array([start, start + n - 1]))
    native = (n - 1) / (ends[1] - ends[0]) if n > 1 and ends[1] > ends[0] else math.inf
    scale = rate / native if math.isfinite(native) and math.isfinite(rate) else 1.0
    for lo in range(start, start + n, CHUNK):
        i = np.arange(lo, min(start + n, lo + CHUNK))
        tau = (stamp(i) - ends[0]) / scale
        r = i % len(rows)
        yield Arrivals(tau if curve is None else warp(curve, tau), ins[r], outs[r])


def arrivals_of(
    args: argparse.Namespace, specs: Sequence[RequestSpec] | None
) -> tuple[Iterator[Arrivals], int]:
    """A trace replay made here, in chunks; any other workload is ``specs`` (made whole by the
    caller: ``pdserve.simulator.run.workload``)."""
    if args.trace is not None:
        if not math.isfinite(args.request_rate):
            raise ValueError("--fluid replays a trace at a rate: give --request-rate")
        n = num_prompts(args)
        curve = rate_curve(args)
        return trace_arrivals(args.trace, args.request_rate, n, getattr(args, "trace_start", 0), curve), n
    if specs is None:
        raise ValueError("--fluid without --trace needs the workload's requests")
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_s)
    a = Arrivals(
        np.array([specs[i].arrival_s for i in order], dtype=np.float64),
        np.array([specs[i].prompt_len for i in order], dtype=np.int64),
        np.array([specs[i].output_len for i in order], dtype=np.int64),
    )
    return iter([a]), len(specs)


class FluidAutoscaler(PlannerLoop[Role]):
    """The planner on the fluid model: ``SimAutoscaler``'s measures and moves."""

    roles = (Role.PREFILL, Role.DECODE)

    def __init__(self, cluster: FluidCluster, planner: Planner, config: AutoscaleConfig) -> None:
        super().__init__(planner, config)
        self.cluster = cluster
        self.ends: deque[Ended] = deque()
        cluster.log_arrivals = True

    def layout(self) -> Layout:
        return Layout(*self.cluster.counts())

    def record(self, ended: list[Ended]) -> None:
        self.ends.extend(ended)
        now = self.cluster.now
        horizon = now - self.config.interval_s - 1.0  # the longest window whose ends are read
        while self.ends and (not len(self.ends[0].end) or self.ends[0].end.max() < horizon):
            self.ends.popleft()
        # arrivals: the decode pool's window reaches further (``LoadMemory.decode_window``)
        horizon = now - self.config.interval_s * self.planner.config.down_after - 1.0
        log = self.cluster.arrival_log
        while log and log[0][0] < horizon:
            log.popleft()

    def _logged(self, now: float, span: float) -> tuple[float, list[np.ndarray], float]:
        """The window's arrivals as the ticks logged them: (output tokens, prompt lengths by
        tick, the ticks' span: the rate is over the ticks the window holds)."""
        output, prompts = 0.0, []
        for t, o, p in reversed(self.cluster.arrival_log):
            if t <= now - span + 1e-9:
                break
            output += o
            prompts.append(p)
        tick = self.cluster.config.tick_s
        return output, prompts, math.ceil(span / tick - 1e-9) * tick

    def arrivals(self, now: float, span: float) -> Workload:
        output, prompts, covered = self._logged(now, span)
        n = sum(len(p) for p in prompts)
        prompt = sum(int(p.sum()) for p in prompts)
        return Workload(n / covered, prompt / n if n else 0.0, output / n if n else 0.0, span_s=covered)

    def observe(self, now: float, span: float) -> Observation:
        c, cfg = self.cluster, self.planner.config
        output, prompts, covered = self._logged(now, span)
        lens = np.concatenate(prompts) if prompts else np.zeros(0, dtype=np.int64)
        n, prompt = len(lens), float(lens.sum())
        # ``prompt_shape`` without a Python list of a window at scale
        lens.sort()
        tail = float(lens[rank(n, cfg.quantile)]) if n else 0.0
        sums = np.cumsum(lens)
        light = tuple((a, float(sums[k - 1]) / k if k else 0.0) for a in cfg.shares for k in [kept(n, a)])
        end = np.concatenate([e.end for e in self.ends]) if self.ends else np.zeros(0)
        arrival = np.concatenate([e.arrival for e in self.ends]) if self.ends else end
        # what the present layout served: requests that arrived before it took its form measure
        # the layout they arrived under (``Observation.requests``)
        window = (end > now - span) & (end <= now)
        inside = window & (arrival >= c.layout_since)
        ttft = np.concatenate([e.ttft for e in self.ends])[inside] if self.ends else end
        tpot = np.concatenate([e.tpot for e in self.ends])[inside] if self.ends else end
        goods = np.concatenate([e.good for e in self.ends]) if self.ends else end
        all_good, good = goods[window], goods[inside]
        served = ~np.isnan(ttft)
        ttfts, tpots = np.sort(ttft[served]), tpot[served]
        q = cfg.quantile
        requests, n_all = int(inside.sum()), int(window.sum())
        return Observation(
            t=now,
            layout=self.layout(),
            load=Workload(
                n / covered, prompt / n if n else 0.0, output / n if n else 0.0, 0.0, tail, light, covered
            ),
            requests=requests,
            attainment=float(good.sum()) / requests if requests else math.nan,
            ended=(n_all, float(all_good.sum()) / n_all if n_all else math.nan),
            ttft_s=float(ttfts[rank(len(ttfts), q)]) if len(ttfts) else math.nan,
            tpot_s=float(np.median(tpots)) if len(tpots) else math.nan,
            warming=c.starting() or now - c.last_join < self.config.warmup,
        )

    def serving(self, role: Role) -> int:
        return len(self.cluster.pool(role))

    def switch(self, src: Role, dst: Role) -> None:
        self.cluster.retire(self.cluster.idlest(src), switch_to=dst)

    def start(self, role: Role) -> None:
        self.cluster.add_worker(role, ready_in_s=self.config.start_s)

    def stop(self, role: Role) -> None:
        self.cluster.retire(self.cluster.idlest(role))

    def worker_seconds(self, until: float) -> float:
        return self.cluster.worker_seconds(until)


def simulate_fluid(
    args: argparse.Namespace, specs: Sequence[RequestSpec] | None = None, progress: bool = False
) -> dict[str, Any]:
    """``args`` as ``pdserve simulate`` takes them (disaggregated layouts only); ``specs``: the
    requests of a workload other than a trace replay."""
    if getattr(args, "colocated", 0):
        raise ValueError("--fluid models disaggregated layouts: not with --colocated")
    if getattr(args, "shared_host", False):
        raise ValueError("--fluid models GPU workers: not with --shared-host")
    if args.policy == "goodput" and getattr(args, "local_prefill", True):
        raise ValueError(
            "--fluid does not prefill on decode workers: with --policy goodput add --no-local-prefill"
        )
    profile = load_sim_profile(args.profile)
    slo = Slo.parse(args.goodput)
    ttft, tpot = (slo.ttft_ms or 0.0) / 1000, (slo.tpot_ms or 0.0) / 1000
    config = FluidConfig(
        ttft,
        tpot,
        reject=getattr(args, "admission", "none") == "reject",
        step_tokens=args.max_num_batched_tokens,
        max_seqs=args.max_num_seqs,
        reserve_timeout_s=args.reserve_timeout_s,
        tick_s=args.fluid_tick,
    )
    cluster = FluidCluster(profile, args.prefill, args.decode, config)
    scaler = None
    auto = AutoscaleConfig(args.autoscale_interval, args.worker_start_s)
    if args.autoscale:
        if not (ttft and tpot):
            raise ValueError("--autoscale needs both targets: --goodput ttft:MS tpot:MS")
        planner = Planner(profile, planner_settings(args, ttft, tpot, config.reject, config.max_seqs))
        scaler = FluidAutoscaler(cluster, planner, auto)
    look = auto.interval_s / auto.checks
    if scaler is not None and config.tick_s > look + 1e-9:
        raise ValueError(
            f"--fluid-tick {config.tick_s:g} is longer than the planner's checks ({look:g} s apart)"
        )
    arrivals, n = arrivals_of(args, specs)
    # A layout that can no longer reach ``stop_below`` (misses past what it allows) ends early.
    stop_below = getattr(args, "stop_below", None)
    allowed = math.inf if stop_below is None else (1 - stop_below) * n
    stopped = False
    t0 = time.perf_counter()
    last_print, next_look, end = t0, look, 0.0
    last_arrival = 0.0
    hourly = Hourly()
    for t1, batch, more in ticks(arrivals, config.tick_s):
        if len(batch.t):
            last_arrival = float(batch.t[-1])
        elif not more and t1 > last_arrival + DRAIN_S:
            # nothing takes this long to end (a reservation fails after 30 s, a request decodes
            # in minutes): a request the model lost would otherwise keep it ticking for ever
            raise AssertionError(
                f"fluid model: not drained {DRAIN_S:g} s after the last arrival: {cluster.request_state()}"
            )
        cluster.tick(t1, batch)
        cluster.settle(auto.switch_s)
        ended = cluster.take_ended()
        hourly.ended(ended)
        hourly.tick(t1, cluster)
        for e in ended:
            if len(e.end):
                end = max(end, float(e.end.max()))
        if scaler is not None:
            scaler.record(ended)
        if t1 >= next_look - 1e-9:
            next_look += look
            if scaler is not None and (more or cluster.busy):
                scaler.look(t1)
        if progress and time.perf_counter() - last_print > 10:
            last_print = time.perf_counter()
            p, d = cluster.counts()
            print(f"  simulated {t1:,.0f} s: {cluster.offered:,} of {n:,} requests, {p}P+{d}D", flush=True)
        if not more and not cluster.busy:
            break
        if cluster.ended - cluster.good > allowed:
            stopped = True
            break
    wall = time.perf_counter() - t0
    held = {k: v for k, v in cluster.request_state().items() if v}
    if held and not stopped:  # every run ends with every request ended and nothing held
        raise AssertionError(f"fluid model: state left after the run: {held}")
    offered = cluster.offered
    m: dict[str, Any] = {
        "simulated": True,
        "fidelity": "fluid",
        "profile": profile.name,
        "layout": f"{args.prefill}P+{args.decode}D",
        "num_prompts": n,
        "completed": offered - cluster.rejected - cluster.failed,
        "rejected": cluster.rejected,
        "failed": cluster.failed,
        # stopped early: the most it could still have reached
        "slo_attainment": (
            None
            if slo.empty or not offered
            else (n - (cluster.ended - cluster.good)) / n
            if stopped
            else cluster.good / offered
        ),
        "stopped_early": stopped,
        "duration": end,
        "worker_seconds": cluster.worker_seconds(end),
        "by_hour": hourly.rows(end, cluster),
        "simulation_wall_s": wall,
    }
    if scaler is not None:
        m["autoscale"] = scaler.summary(end)
    return m


def print_fluid(m: dict[str, Any]) -> None:
    att = m["slo_attainment"]
    print(
        f"fluid model, {m['profile']}, {m['layout']} at the start: {m['num_prompts']:,} requests, "
        f"{m['completed']:,} served, {m['rejected']:,} refused, {m['failed']:,} failed"
    )
    if att is not None:
        print(f"SLO attainment: {att:.4f}")
    print(
        f"GPU-hours: {m['worker_seconds'] / 3600:,.1f} over {m['duration'] / 3600:.2f} h "
        f"(simulated in {m['simulation_wall_s']:.0f} s)"
    )
    a = m.get("autoscale")
    if a is not None:
        print(f"planner: {a['changes']} changes in {a['decisions']} decisions")
        for t, reason, p, d, detail in a["reasons"][-20:]:
            print(f"  {t:>9,.0f} s  {reason:<11} -> {p}P+{d}D  {detail}")
