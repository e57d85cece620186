"""The pool planner: every interval, the smallest layout predicted to meet the SLO (pure).

``Planner.decide(observation)`` returns where the pools should be and why. It predicts each
candidate (P prefill, D decode) within the bounds with ``pdserve.deploy.capacity`` on the
step-time model, corrected twice by what the router measured: the model's prefill and decode
factors (the router's online corrections), and the planner's own correction of the step times
under which the layouts that served the recent windows predict the TTFT / TPOT measured in them
(``step_correction``: a factor on prefill, a factor and a fixed cost a step on decode). Then::

    current layout misses (measured or predicted)   -> the smallest layout that meets and
                                                       keeps up, at once (SCALE_UP; a worker
                                                       moved between the pools instead when
                                                       that is enough: SWITCH; between decisions
                                                       only a measured miss, a load it cannot
                                                       keep up with at all, or a step — a window
                                                       ``step_above`` times the busiest one
                                                       remembered — counts, and during a warm-up
                                                       only the second)
    fewer workers meet each of the last
    ``down_after`` intervals' loads (fewer after a
    fall of the load) with margin, serving every
    request, and keep up                             -> the smallest such layout (SCALE_DOWN:
                                                       workers stop, none switches)
    otherwise                                        -> HOLD

"Meets" may count on the router's admission when it refuses what it predicts to miss
(``shed`` > 0, admission ``reject``): a layout meets when, refusing the heaviest prompts up to
``shed`` of the arrivals, the rest meet the targets at ``quantile / admitted``
(``capacity.predict``) — the SLO counts a refusal as a miss, and under a heavy-tailed prompt
mix a few refusals free a large share of the prefill pool. Where it counts on them:

- holding: a layout that meets by refusing a few of the heaviest is not grown;
- growing on a tail over its target (measured or predicted) while the layout keeps up: the
  smallest layout that meets, refusals counted;
- growing on a load the layout cannot keep up with even refusing (a queue building, as
  through a load step): the smallest that serves every request — the backlog must drain, and
  a layout at the edge of its refusals would refuse it instead;
- never on the way down (tails with margin and the keep-up floor both serve every request):
  the gap between up and down is the hysteresis that keeps a layout sized at the edge of its
  refusals from stepping into a miss and back (at 64 workers it did, every few intervals).

A tail measured outranks a tail predicted: where the window measured the serving layout's
TTFT (or TPOT) tail within ``trust`` of its target while meeting the attainment, on most of
its arrivals (``MEASURED_SAMPLE``; not across a step or a fall), that pool at its size or
larger counts as meeting whatever tail the model predicts for it — the model is then what is
off (a prefill factor learned on windows with another prompt tail), not the pool. Whether a
pool keeps up is never overruled: a queue without end shows in the tails only once it has grown.

"Keeps up": each pool at least the fewest workers predicted to keep up with every window the
checks of the last ``down_after`` intervals saw, plus ``headroom`` — at scale a 10 s window
carries a fifth more than its interval's mean, and a layout sized for one window would be
moved again by the next (the busiest for prefill is not the busiest for decode). Decode reads
each look's longer window (``decode_span``: as long as a request decodes at the TPOT target):
a prefill queue costs TTFT at once, while a decode pool rides out a burst shorter than that in
its batch and queue, and sized for every 10 s burst it held workers the SLO never needed.
The headroom shrinks with the square root of a window's length past ``headroom_span_s``: the
busiest of the 90 s decode windows plus a tenth put a decode worker past its batch cap where
the static layout served the same peak on one.

With ``spend`` > 0 the planner spends the SLO's error budget: the requests that met beyond
the attainment target over the last ``budget_intervals`` windows are a bank, and growing and
holding size the next interval for a lower attainment (down to the target less the SLO's own
allowance) whose extra misses spend up to ``spend`` of it: a quiet stretch pays for a trough
held on fewer workers, and a step's misses empty the bank, so the next growth sizes for the
target again. The way down never spends it (its margin is what keeps the pools from cycling).

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

Flapping is what the peers' users complain of (a 2 <-> 1 oscillation), so the way down is
deliberately narrower than the way up: a smaller layout must meet the SLO with ``margin`` (its
predicted tails at most ``margin`` × the targets) for several intervals, and no scale-down
follows a change within ``cooldown`` intervals. Nothing arriving is not a reason to panic or
to divide by zero: the prediction of an empty window is an unloaded worker's, so the pools
step down to their minimum (whatever the corrections learned under load say of an idle worker).
Measurements from workers still warming up are the caller's to
leave out (``Observation.warming``: the layout is held while any is, unless the arriving load
alone is more than it can keep up with).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from pdserve.deploy.capacity import Prediction, decode_step_at, predict
from pdserve.deploy.planner_data import Decision, Layout, Observation, PlannerConfig, Reason
from pdserve.deploy.step_correction import NONE, DecodePoint, StepCorrection, fit_decode, solve
from pdserve.router.workload_window import Workload
from pdserve.steptime.model import StepTimeModel

# the share of a window's arrivals that must have ended in it for its measured tails to stand
# for the load priced (``Planner._measured_within``)
MEASURED_SAMPLE = 0.5


class Planner:
    def __init__(self, model: StepTimeModel, config: PlannerConfig) -> None:
        self.model = model
        self.config = config
        self.correction = NONE  # of the model's step times (``_learn``)
        self._decode_points: deque[DecodePoint] = deque(maxlen=config.fit_windows)  # what it is fitted to
        # the check windows of the last ``down_after`` intervals: a layout the planner moves to
        # must keep up with each, or the next check moves it again (at scale a 10 s window
        # carries a fifth more than its interval's mean, and the busiest for prefill is not the
        # busiest for decode)
        self._bursts: deque[list[Observation]] = deque(maxlen=config.down_after)
        self._burst: list[Observation] = []  # this interval's, so far
        self._fallen = False  # the memory restarted at a fall of the load (``forget_below``)
        self._fell_at = -math.inf  # when the last fall began (``Observation.t``'s clock)
        self._rose_at = -math.inf  # when the last step up began (likewise)
        self._floor: dict[float, tuple[int, int]] = {}  # fewest (P, D) keeping up, by shed: this decision's
        self._since_change = config.cooldown
        # (ended, met) of the last decisions' windows: the error budget's bank
        self._ledger: deque[tuple[int, float]] = deque(maxlen=config.budget_intervals)
        self.quantile = config.quantile  # the one growing and holding size for (``spend``)

    def decode_span(self, span_s: float, interval_s: float, output_tokens: float) -> float:
        """How long a window the decode pool is sized on, where ``span_s`` is the window looked
        at (``Observation.decode_load``): as long as a request of ``output_tokens`` decodes at
        the TPOT target, at most the ``down_after`` intervals the planner remembers. A decode
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
        longest = min(self.config.down_after * interval_s, elapsed_s, now - self._moved_at)
        if longest <= span_s:
            return None
        widest = load_over(longest)
        longer = min(longest, self.decode_span(span_s, interval_s, widest.output_tokens))
        if longer <= span_s:
            return None
        return widest if longer >= longest else load_over(longer)

    def predict(self, obs: Observation, layout: Layout, shed: float | None = None) -> Prediction:
        """``layout``'s corrected prediction for ``obs``'s workload: serving every arrival, or
        refusing the heaviest of them up to ``shed`` (the config's by default), whichever is
        nearer the targets (the router refuses only what it predicts to miss)."""
        most = self.config.shed if shed is None else shed
        shares = [1.0, *(a for a, _ in obs.load.light if a in self.config.shares and a >= 1 - most - 1e-9)]
        # ties (both tails unbounded) go to the lower TTFT: what refusing does for prefill
        return min((self._price(obs, layout, a) for a in shares), key=lambda p: (self._excess(p), p.ttft_s))

    def _price(
        self,
        obs: Observation,
        layout: Layout,
        admitted: float,
        quantile: float | None = None,
        correction: StepCorrection | None = None,
    ) -> Prediction:
        """``layout``'s prediction with the step times corrected by ``correction`` (the learned
        one by default) on top of the router's factors."""
        q = self.quantile if quantile is None else quantile
        c = self.correction if correction is None else correction
        return predict(
            self.model,
            obs.load,
            layout.prefill,
            layout.decode,
            q,
            (obs.factors[0] * c.prefill, obs.factors[1] * c.decode),
            admitted,
            max_seqs=self.config.max_seqs,
            decode_load=obs.decode_load,
            decode_fixed_s=c.decode_fixed_s,
        )

    def _excess(self, p: Prediction) -> float:
        return max(p.ttft_s / self.config.ttft_s, p.tpot_s / self.config.tpot_s)

    def _meets(self, p: Prediction, share: float) -> bool:
        return p.ttft_s <= share * self.config.ttft_s and p.tpot_s <= share * self.config.tpot_s

    def _measured_within(self, obs: Observation, moved: bool) -> tuple[bool, bool]:
        """Whether ``obs``'s window measured the serving layout's TTFT tail, and its TPOT,
        within ``trust`` of their targets while meeting the attainment, on a sample that speaks
        for the window's arrivals: at least ``MEASURED_SAMPLE`` of them ended, so that the load
        measured is the load priced (a step's arrivals have mostly not ended yet, and a window
        the load ``moved`` in — a step, a fall — counts nothing). Where it did, the pool's tail
        is a fact about this load, and a prediction over the target for it is the model's error
        (the learned prefill factor is solved from windows whose prompt tails differ, and a
        window with a heavier tail than the one it was learned on is priced past the target
        while every request meets it): growing on it adds a worker the SLO never needed."""
        c = self.config
        arrived = obs.load.rate * obs.load.span_s
        sample = (
            c.trust > 0
            and not moved
            and not obs.warming
            and arrived > 0
            and obs.requests >= max(c.min_requests, MEASURED_SAMPLE * arrived)
            and obs.attainment >= self.quantile  # False for NaN
        )
        return sample and obs.ttft_s <= c.trust * c.ttft_s, sample and obs.tpot_s <= c.trust * c.tpot_s

    def _fits(self, p: Prediction, layout: Layout, current: Layout, within: tuple[bool, bool]) -> bool:
        """``_meets`` at the targets, except that a pool no smaller than the serving one, whose
        tail the window measured ``within`` trust (``_measured_within``), meets on any finite
        prediction: the measurement outranks the model's tail, never its keeping up (a queue
        without end shows in the tails only once it has grown)."""
        c = self.config
        prefill = within[0] and layout.prefill >= current.prefill and math.isfinite(p.ttft_s)
        decode = within[1] and layout.decode >= current.decode and math.isfinite(p.tpot_s)
        return (p.ttft_s <= c.ttft_s or prefill) and (p.tpot_s <= c.tpot_s or decode)

    def _learn(self, obs: Observation) -> None:
        """Fold the window's measured TTFT tail and TPOT into the correction
        (``step_correction``): only with enough requests, and only where the model has the
        layout keeping up — on a layout it sees unable to keep up the tails measure a growing
        queue (how long the overload lasted, not how far off the model is), and learning from
        them overshoots the next scale-up. A correction of the step time, not of the tail: a
        worker 30 % slower than its profile is 30 % slower at light load and past saturation at
        80 % of the profile's capacity, and a tail ratio learned in a trough priced the peak as
        30 % slower, not as a queue without end."""
        if obs.requests < self.config.min_requests or obs.warming:
            return
        q = self.config.quantile  # the measured tails are of served requests, at the SLO's quantile
        if not self._price(obs, obs.layout, 1.0, quantile=q, correction=NONE).feasible:
            return
        c = self.correction
        if math.isfinite(obs.ttft_s) and obs.ttft_s > 0:

            def tail(f: float) -> float:
                by = StepCorrection(prefill=f)
                return self._price(obs, obs.layout, 1.0, quantile=q, correction=by).ttft_s

            # half the way: one noisy window moves it half
            c = replace(c, prefill=0.5 * c.prefill + 0.5 * solve(tail, obs.ttft_s))
        load = obs.load if obs.decode_load is None else obs.decode_load
        step = decode_step_at(self.model, load, obs.layout.decode, obs.tpot_s, self.config.max_seqs)
        if step is not None:
            self._decode_points.append(DecodePoint(step * obs.factors[1], obs.tpot_s))
            factor, fixed = fit_decode(self._decode_points)
            c = replace(c, decode=factor, decode_fixed_s=fixed)
        self.correction = c

    def candidates(self) -> list[Layout]:
        b = self.config.bounds
        return [
            Layout(p, d)
            for p in range(b.min_prefill, b.max_prefill + 1)
            for d in range(b.min_decode, b.max_decode + 1)
        ]

    def decide(self, obs: Observation, up_only: bool = False) -> Decision:
        """The decision for ``obs``. ``up_only``: a check between decisions, on a shorter
        window — it may grow the pools (a load step should not wait for the next decision),
        but only on a measured miss or a load the layout cannot keep up with at all; it learns
        nothing, counts no interval and never shrinks them."""
        d = self._decide(obs, up_only)
        spent = self.quantile < self.config.quantile - 5e-4
        if spent and d.reason not in (Reason.SCALE_DOWN, Reason.WARMING) and "bounds" not in d.detail:
            note = f"spending the error budget: sized for {self.quantile:.3f}"
            d = replace(d, detail=f"{d.detail}; {note}" if d.detail else note)
        return d

    def _decide(self, obs: Observation, up_only: bool) -> Decision:
        c = self.config
        current = c.bounds.clamp(obs.layout)
        self._floor = {}
        # What ended in a window that arrivals fell off from are mostly requests the busier
        # load queued: their tails measure that backlog draining, not this layout at this load
        # (growing on them adds workers that start after the backlog is gone).
        busiest = self._busiest(up_only)
        draining = busiest > 0 and obs.load.rate < c.forget_below * busiest
        stepped = up_only and self._stepped(obs)
        if up_only:
            if stepped:
                if not any(self._stepped(w) for w in self._burst):  # the step's first check
                    self._rose_at = obs.t - obs.load.span_s
                obs = self._since_moved(obs)  # decode priced on what arrived since the step
            self._burst.append(obs)
        else:
            self._since_change += 1
            if not draining:
                self._learn(obs)
            interval = [*self._burst, obs]
            if self._fell(interval):
                self._bursts.clear()
                self._fallen = True
                self._fell_at = min(w.t - w.load.span_s for w in interval)
                # decode priced on what arrived since: the workers it retires drain their own
                interval = [self._since_moved(w) for w in interval]
                obs = interval[-1]
            self._bursts.append(interval)
            self._burst = []
            self.quantile = self._budgeted_quantile(obs)
        now_pred = self.predict(obs, current)
        if obs.warming:
            # A warm-up skews what the workers measure (their first steps, the backlog they were
            # started for), not what arrives: a load that even the layout with its new workers
            # cannot keep up with grows it further, on the prediction alone.
            if (obs.load.rate > 0 or obs.decode.rate > 0) and current == obs.layout and not now_pred.feasible:
                return self._grow(obs, current, now_pred, False, False, (False, False))
            return Decision(obs.t, Reason.WARMING, obs.layout, now_pred, "new workers warming up")
        measured_miss = obs.requests >= c.min_requests and obs.attainment < self.quantile  # False for NaN
        backlog = ""
        if measured_miss and draining:
            measured_miss = False
            backlog = (
                f"attainment {obs.attainment:.2f} < {self.quantile:.3g} measured on a backlog: "
                f"arrivals at {obs.load.rate / busiest:.2f} of the busiest recent window"
            )
        if current != obs.layout and not (up_only and current.workers < obs.layout.workers):
            # outside the bounds (they changed, or a worker was lost)
            up = current.workers > obs.layout.workers
            return self._change(
                obs, Reason.SCALE_UP if up else Reason.SCALE_DOWN, current, now_pred, "back within the bounds"
            )
        if up_only and not measured_miss and now_pred.feasible and not stepped:
            # A check's short window sees the trace's bursts as well as steps: between decisions
            # only what is certain grows the pools (a measured miss, a load the layout cannot
            # keep up with at all, or a step: arrivals far past every window remembered); a
            # tail merely predicted over the target on a burst waits for the decision's window.
            return Decision(obs.t, Reason.HOLD, current, now_pred, backlog or "between decisions")
        ranked = self._ranked(current)
        # Nothing arrived and nothing ended: there is no load to size for, and the corrections
        # (learned under load, queueing included) would price an idle worker as a busy one.
        idle = obs.load.rate == 0 and obs.decode.rate == 0 and obs.requests == 0
        within = self._measured_within(obs, stepped or draining)
        predicted_ok = idle or self._fits(now_pred, current, current, within)
        if measured_miss or not predicted_ok:
            return self._grow(obs, current, now_pred, measured_miss, predicted_ok, within)
        held = ""
        if not idle and not self._meets(now_pred, 1.0):
            held = (
                f"predicted TTFT {now_pred.ttft_s * 1e3:.0f} ms / TPOT {now_pred.tpot_s * 1e3:.1f} ms; "
                f"measured within {c.trust:g} of the targets"
            )
        if up_only:
            return Decision(obs.t, Reason.HOLD, current, now_pred, held or "between decisions")
        if backlog:
            # not a reason to grow, nor a window to step down in: the workers being drained
            # would hand their share of the backlog to fewer
            return Decision(obs.t, Reason.HOLD, current, now_pred, backlog)
        # Down: only by stopping workers, to the smallest layout that would have met each of the
        # last ``down_after`` intervals' loads with margin (priced now, with what has been learned
        # since) serving every request, and keeps up with their checks' windows; never within
        # the cooldown; no refusals counted on (the module's docstring).
        if self._since_change <= c.cooldown or (len(self._bursts) < c.down_after and not self._fallen):
            return Decision(obs.t, Reason.HOLD, current, now_pred, held)
        recent = [ws[-1] for ws in reversed(self._bursts)]  # the decisions' windows, this one first

        def met(l: Layout) -> bool:  # at the SLO's own quantile: the budget is not spent going down
            return all(
                (w.load.rate == 0 and w.decode.rate == 0 if i else idle)
                or self._meets(self._price(w.now(obs), l, 1.0, quantile=c.quantile), c.margin)
                for i, w in enumerate(recent)
            )

        best = next(
            (
                l
                for l in ranked
                if l.workers < current.workers
                and l.prefill <= current.prefill
                and l.decode <= current.decode
                and self._keeps_up(obs, l, below=current, shed=0.0)
                and met(l)
            ),
            None,
        )
        if best is not None:
            n = len(recent)
            since = f"the last {n} intervals" if n >= c.down_after else "the interval since the load fell"
            if 1 < n < c.down_after:
                since = f"the {n} intervals since the load fell"
            why = f"{best.prefill}P+{best.decode}D meets the loads of {since} with margin {c.margin}"
            return self._change(obs, Reason.SCALE_DOWN, best, self.predict(obs, best, shed=0.0), why)
        return Decision(obs.t, Reason.HOLD, current, now_pred, held)

    @property
    def _moved_at(self) -> float:
        """When the last fall or step of the load began: no decode window reaches before it."""
        return max(self._fell_at, self._rose_at)

    def _since_moved(self, w: Observation) -> Observation:
        """``w`` with its decode window cut to its own where it reaches before the last fall
        or step of the load."""
        d = w.decode_load
        if d is not None and w.t - d.span_s < self._moved_at - 1e-6:
            return replace(w, decode_load=None)
        return w

    def _stepped(self, obs: Observation) -> bool:
        """Whether ``obs``'s window carries at least ``step_above`` times the arrivals a second
        of the busiest window of the intervals remembered before this one: a step in the load,
        not a burst of the trace (at a steady load a check window carries some tens of percent
        over its interval's mean, and the busiest of the nine remembered more)."""
        before = [w.load.rate for ws in self._bursts for w in ws]
        return bool(before) and obs.load.rate >= self.config.step_above * max(before) > 0

    def _busiest(self, check: bool) -> float:
        """The most arrivals a second of the remembered windows as long as the one being
        decided on: for a check, the checks' windows (this interval's so far among them); for a
        decision, the intervals' own windows that stay remembered (``_fell``'s reference). Like
        with like: a steady load with one burst window an interval is not a fall at every
        decision."""
        if check:
            checks = [w for ws in self._bursts for w in ws[:-1]] + self._burst
            return max((w.load.rate for w in checks), default=0.0)
        return max((ws[-1].load.rate for ws in self._kept()), default=0.0)

    def _kept(self) -> list[list[Observation]]:
        """The remembered intervals that stay once a decision's interval joins: the oldest
        leaves with it when the memory is full."""
        full = len(self._bursts) == self._bursts.maxlen
        return list(self._bursts)[1:] if full else list(self._bursts)

    def _fell(self, interval: list[Observation]) -> bool:
        """Whether every window of ``interval`` carried less than ``forget_below`` of the busiest
        remembered one that stays remembered (the module's docstring: a fall, or as deep a lull)."""
        # against what stays remembered: the oldest interval leaves with this one's arrival, and
        # a gradual decline measured against it would wipe intervals not half as busy again
        busiest = max((w.load.rate for ws in self._kept() for w in ws), default=0.0)
        return busiest > 0 and all(w.load.rate < self.config.forget_below * busiest for w in interval)

    def _budgeted_quantile(self, obs: Observation) -> float:
        """The quantile growing and holding size the next interval for: the SLO's, less what
        spending ``spend`` of the banked surplus (met requests beyond the quantile over the last
        ``budget_intervals`` windows) on its expected requests allows, at most the SLO's own
        allowance (``1 - quantile``) below it."""
        c = self.config
        # every request the SLO counted, whatever layout it arrived under; a window where
        # nothing ended banks nothing but still ages the bank
        n, attainment = obs.served
        ended = n if math.isfinite(attainment) else 0
        self._ledger.append((ended, ended * attainment if ended else 0.0))
        if not c.spend:
            return c.quantile
        # the windows still inside the horizon when the next one ends (the oldest leaves it)
        kept = list(self._ledger)[-(c.budget_intervals - 1) :]
        bank = sum(met - c.quantile * n for n, met in kept)
        # the next interval may carry as many requests as the busiest recent one (a quiet window
        # must not let a small bank lower the target for a busy one)
        expected = max(c.min_requests, *(n for n, _ in kept))
        return c.quantile - min(1 - c.quantile, max(0.0, c.spend * bank / expected))

    def _keeps_up(
        self, obs: Observation, layout: Layout, below: Layout | None = None, shed: float | None = None
    ) -> bool:
        """``layout`` keeps up with every window of the recent intervals' checks, plus
        ``headroom`` (the checks between decisions grow the pools on a load the layout cannot
        keep up with at all, and the tails' margin says nothing of a decode pool close to
        full: its step time barely moves until it is). ``below``: a layout being shrunk from,
        whose pools count as keeping up where they already are short (a pool under its floor
        is not a reason to hold the other pool's idle workers). ``shed``: the refusals counted
        on (the config's by default)."""
        most = self.config.shed if shed is None else shed
        if most not in self._floor:
            self._floor[most] = self._fewest(obs, most)
        p, d = self._floor[most]
        if below is not None:
            p, d = min(p, below.prefill), min(d, below.decode)
        return layout.prefill >= p and layout.decode >= d

    def _fewest(self, obs: Observation, shed: float) -> tuple[int, int]:
        """The fewest prefill and decode workers that keep up with each recent window (prefill
        and decode are predicted apart: each pool's feasibility is the other's at its largest,
        and grows with the pool)."""
        b = self.config.bounds
        seen = [w for ws in (*self._bursts, self._burst) for w in ws] + [obs]

        def fewest(lo: int, hi: int, keeps_up: Callable[[int], bool]) -> int:
            if not keeps_up(hi):
                return hi
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if keeps_up(mid) else (mid + 1, hi)
            return lo

        p = d = 0
        for w in seen:
            if w.load.rate == 0 and w.decode.rate == 0:
                continue
            o = replace(obs, load=replace(w.load, rate=w.load.rate * self._more(w.load)))
            o = replace(o, decode_load=replace(w.decode, rate=w.decode.rate * self._more(w.decode)))

            def prefill_ok(n: int, o: Observation = o) -> bool:
                return math.isfinite(self.predict(o, Layout(n, b.max_decode), shed).ttft_s)

            def decode_ok(n: int, o: Observation = o) -> bool:
                # refusals spare prefill only: decode is priced serving everyone
                return math.isfinite(self.predict(o, Layout(b.max_prefill, n), 0.0).tpot_s)

            p = max(p, fewest(b.min_prefill, b.max_prefill, prefill_ok))
            d = max(d, fewest(b.min_decode, b.max_decode, decode_ok))
        return p, d

    def _more(self, load: Workload) -> float:
        """The factor on ``load``'s rate a layout must keep up with: ``headroom`` for a window
        up to ``headroom_span_s`` long (or of unknown length), shrinking with the square root of
        a longer one's length — the share by which the count of independent arrivals strays
        from its mean falls so, and a busiest window of 90 s is already most of a burst."""
        c = self.config
        longer = max(1.0, load.span_s / c.headroom_span_s)
        return 1 + c.headroom / math.sqrt(longer)

    def _ranked(self, current: Layout) -> list[Layout]:
        return sorted(self.candidates(), key=lambda l: (l.workers, abs(l.prefill - current.prefill), l))

    def _grow(
        self,
        obs: Observation,
        current: Layout,
        now_pred: Prediction,
        measured_miss: bool,
        predicted_ok: bool,
        within: tuple[bool, bool],
    ) -> Decision:
        """The smallest layout predicted to meet and to keep up with the recent checks' busiest
        window (a move sized for this window alone is moved again by the next, busier in the
        other pool), else the bounds' largest. A miss the model does not see yet calls for more
        workers, not another split, first in the pool whose measured tail is nearer its target
        (the model sees neither short, so its split says nothing of which one is). Refusals
        are counted on only while the layout keeps up (the module's docstring)."""
        c = self.config
        if not now_pred.feasible:
            # A queue building: nothing to spend on (its misses have not all ended yet), and the
            # backlog must drain; sized for the SLO's own target until the next decision.
            self.quantile = c.quantile
            now_pred = self.predict(obs, current)
        ranked = self._ranked(current)
        if predicted_ok:
            ranked = [l for l in ranked if l.workers > current.workers]
            # nothing served (NaN tails: every request refused or failed) blames prefill too
            prefill_first = not obs.ttft_s / c.ttft_s < obs.tpot_s / c.tpot_s
            # the blamed pool's growth first, each total before the next
            ranked = sorted(
                ranked,
                key=lambda l: (
                    l.workers,
                    not (l.prefill > current.prefill if prefill_first else l.decode > current.decode),
                ),
            )
        larger = (l for l in ranked if l.workers >= current.workers and l != current)
        shed = c.shed if now_pred.feasible else 0.0
        meeting = (
            l
            for l in larger
            if self._fits(self.predict(obs, l, shed), l, current, within)
            and self._keeps_up(obs, l, shed=shed)
        )
        need = next(meeting, None)
        why = (
            f"attainment {obs.attainment:.2f} < {self.quantile:.3g}"
            if measured_miss
            else f"predicted TTFT {now_pred.ttft_s * 1e3:.0f} ms / TPOT {now_pred.tpot_s * 1e3:.1f} ms"
        )
        if need is None:
            top = Layout(c.bounds.max_prefill, c.bounds.max_decode)
            if top == current:
                return Decision(obs.t, Reason.HOLD, current, now_pred, f"at the bounds; {why}")
            return self._change(obs, Reason.OVERLOADED, top, self.predict(obs, top), why)
        reason = Reason.SWITCH if need.workers == current.workers else Reason.SCALE_UP
        return self._change(obs, reason, need, self.predict(obs, need), why)

    def _change(
        self, obs: Observation, reason: Reason, to: Layout, pred: Prediction, detail: str
    ) -> Decision:
        self._since_change = 0
        return Decision(obs.t, reason, to, pred, detail)
