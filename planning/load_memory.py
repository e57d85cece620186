"""What the pool planner remembers of the load: the windows its looks saw (pure).

Each interval ends in a decision and holds the checks between decisions before it; the memory
keeps the last ``down_after`` intervals' windows. They are what the keep-up floor sizes the
pools for (``keep_up.fewest``), what a smaller layout must meet on the way down, and the
reference a step or a fall of the load is measured against.

The memory of ``down_after`` intervals is what holds a layout through a trace's bursts; it is
also what held a step's workers three intervals after the step ended. An interval whose every
window carries less than ``forget_below`` of the busiest remembered one restarts it: at a steady
load the quietest 10 s window of a bursty trace stays well above that share of the busiest, so
a fall of the load does — or a whole interval's lull that deep, after which the pools grow again
on the next check (the price of stepping down at once; at a few requests a window, Poisson
noise alone makes such lulls) — and the layout may step down once the cooldown has passed.
Decode too: from the fall's interval on, the decode pool is priced on what arrived since the
fall (the windows that reach before it are cut to the look's own), since the decode workers a
step down retires drain their own requests; a decode window held over the fall kept a
step's decode workers for as long as the window after it. Likewise from a step up on
(``step_above``, seen by a check): a decode window is long because a decode pool rides out a
burst in its batch and slot queue, but a step is no burst: a window averaging it with the
quiet before prices decode for a fraction of the new load, and a decode pool out of KV room
holds up the prefill workers' hand-offs (their KV waits for room), so it misses TTFT too.
The same share marks a window as draining: its arrivals fell under ``forget_below`` of the
busiest remembered window as long as it (a decision's against the intervals' that stay
remembered, a check's against the checks'), so what ended in it is mostly the backlog of the
busier load. Its measured misses grow nothing and its tails teach the corrections nothing
(workers started for a backlog arrive after it is gone, and a correction learned from it
prices the quieter load as the busier one), and it steps nothing down either (a miss is a
miss); the model's own prediction for what arrives still grows the pools.

Every time here is ``Observation.t``'s clock; a window of ``span_s`` ends at its ``t``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from pdserve.planning.planner_data import Observation, PlannerConfig
from pdserve.router.workload_window import Workload


class LoadMemory:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        # the windows of the last ``down_after`` intervals, each interval's checks then its
        # decision's window
        self.intervals: deque[list[Observation]] = deque(maxlen=config.down_after)
        self.checks: list[Observation] = []  # this interval's, so far
        self.fallen = False  # the memory restarted at a fall of the load (``forget_below``)
        self.fell_at = -math.inf  # when the last fall began
        self.rose_at = -math.inf  # when the last step up began

    def windows(self) -> list[Observation]:
        """Every window remembered, this interval's checks so far included."""
        return [w for ws in (*self.intervals, self.checks) for w in ws]

    def decisions(self) -> list[Observation]:
        """The remembered intervals' decision windows, the newest first."""
        return [ws[-1] for ws in reversed(self.intervals)]

    def full(self) -> bool:
        """Whether ``down_after`` intervals are remembered, or the load fell within them (the
        intervals since the fall then speak for the load)."""
        return len(self.intervals) >= self.config.down_after or self.fallen

    def check(self, obs: Observation) -> tuple[Observation, bool]:
        """Remember a check's window; returns it as it is priced (a step's decode window cut to
        the step's arrivals) and whether it is a step."""
        stepped = self.stepped(obs)
        if stepped:
            if not any(self.stepped(w) for w in self.checks):  # the step's first check
                self.rose_at = obs.t - obs.load.span_s
            obs = self.since_moved(obs)  # decode priced on what arrived since the step
        self.checks.append(obs)
        return obs, stepped

    def close(self, obs: Observation) -> Observation:
        """End the interval with its decision's window ``obs``; returns ``obs`` as it is priced
        (after a fall, its decode window cut to what arrived since)."""
        interval = [*self.checks, obs]
        if self.fell(interval):
            self.intervals.clear()
            self.fallen = True
            self.fell_at = min(w.t - w.load.span_s for w in interval)
            # decode priced on what arrived since: the workers it retires drain their own
            interval = [self.since_moved(w) for w in interval]
            obs = interval[-1]
        self.intervals.append(interval)
        self.checks = []
        return obs

    @property
    def moved_at(self) -> float:
        """When the last fall or step of the load began: no decode window reaches before it."""
        return max(self.fell_at, self.rose_at)

    def since_moved(self, w: Observation) -> Observation:
        """``w`` with its decode window cut to its own where it reaches before the last fall
        or step of the load."""
        d = w.decode_load
        if d is not None and w.t - d.span_s < self.moved_at - 1e-6:
            return replace(w, decode_load=None)
        return w

    def stepped(self, obs: Observation) -> bool:
        """Whether ``obs``'s window carries at least ``step_above`` times the arrivals a second
        of the busiest window of the intervals remembered before this one: a step in the load,
        not a burst of the trace (at a steady load a check window carries some tens of percent
        over its interval's mean, and the busiest of the nine remembered more)."""
        before = [w.load.rate for ws in self.intervals for w in ws]
        return bool(before) and obs.load.rate >= self.config.step_above * max(before) > 0

    def busiest(self, check: bool) -> float:
        """The most arrivals a second of the remembered windows as long as the one being
        decided on: for a check, the checks' windows (this interval's so far among them); for a
        decision, the intervals' own windows that stay remembered (``fell``'s reference). Like
        with like: a steady load with one burst window an interval is not a fall at every
        decision."""
        if check:
            checks = [w for ws in self.intervals for w in ws[:-1]] + self.checks
            return max((w.load.rate for w in checks), default=0.0)
        return max((ws[-1].load.rate for ws in self.kept()), default=0.0)

    def kept(self) -> list[list[Observation]]:
        """The remembered intervals that stay once a decision's interval joins: the oldest
        leaves with it when the memory is full."""
        full = len(self.intervals) == self.intervals.maxlen
        return list(self.intervals)[1:] if full else list(self.intervals)

    def fell(self, interval: list[Observation]) -> bool:
        """Whether every window of ``interval`` carried less than ``forget_below`` of the busiest
        remembered one that stays remembered (the module's docstring: a fall, or as deep a lull)."""
        # against what stays remembered: the oldest interval leaves with this one's arrival, and
        # a gradual decline measured against it would wipe intervals not half as busy again
        busiest = max((w.load.rate for ws in self.kept() for w in ws), default=0.0)
        return busiest > 0 and all(w.load.rate < self.config.forget_below * busiest for w in interval)

    def decode_span(self, span_s: float, interval_s: float, output_tokens: float) -> float:
        """How long a window the decode pool is sized on, where ``span_s`` is the window looked
        at (``Observation.decode_load``): as long as a request of ``output_tokens`` decodes at
        the TPOT target, at most the ``down_after`` intervals remembered. A decode
        worker absorbs a burst past its rate in its batch and its queue: a request that waits
        ``w`` for a slot adds ``w / output`` to its TPOT, so a mean request tolerates waits of
        its output times the gap between the target and the step time (tens of seconds), and a
        pool sized for each 10 s burst holds workers the SLO never needed."""
        return min(self.config.down_after * interval_s, max(span_s, output_tokens * self.config.tpot_s))

    def decode_window(
        self,
        span_s: float,
        interval_s: float,
        elapsed_s: float,
        load_over: Callable[[float], Workload],
        now: float = math.inf,
    ) -> Workload | None:
        """``Observation.decode_load`` for a look at ``span_s``: ``load_over(s)`` measures the
        last ``s`` seconds; None when the decode window is no longer than the look's. Never
        longer than ``elapsed_s`` (the time measured so far: a window reaching before it would
        count its empty start as a lull), nor reaching before the last fall or step of the load,
        where ``now`` is the look's ``Observation.t`` (it would count the fallen load as still
        arriving, or a step's as a burst); the output length that sets it is read on the longest
        window (a short window's few requests, or none, would set it by chance)."""
        longest = min(self.config.down_after * interval_s, elapsed_s, now - self.moved_at)
        if longest <= span_s:
            return None
        widest = load_over(longest)
        longer = min(longest, self.decode_span(span_s, interval_s, widest.output_tokens))
        if longer <= span_s:
            return None
        return widest if longer >= longest else load_over(longer)
