"""The pool planner: every interval, the smallest layout predicted to meet the SLO (pure).

``Planner.decide(observation)`` returns where the pools should be and why. It predicts each
candidate (P prefill, D decode) within the bounds with ``pdserve.planning.capacity`` on the
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
planner remembers, plus ``headroom`` (``keep_up``).

With ``spend`` > 0 growing and holding spend the SLO's error budget (``error_budget``); the
way down never does. What the planner remembers of the load — the windows of the last
``down_after`` intervals, a fall of the load that restarts them, a step, a draining window —
is ``load_memory``'s.

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
from dataclasses import replace

from pdserve.planning.capacity import Prediction, decode_step_at, predict
from pdserve.planning.error_budget import ErrorBudget
from pdserve.planning.keep_up import fewest
from pdserve.planning.load_memory import LoadMemory
from pdserve.planning.planner_data import Decision, Layout, Observation, PlannerConfig, Reason
from pdserve.planning.step_correction import NONE, DecodePoint, StepCorrection, fit_decode, solve
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
        # the windows of the last ``down_after`` intervals: a layout the planner moves to must
        # keep up with each, or the next check moves it again (at scale a 10 s window carries a
        # fifth more than its interval's mean, and the busiest for prefill is not the busiest
        # for decode)
        self.memory = LoadMemory(config)
        self._floor: dict[float, tuple[int, int]] = {}  # fewest (P, D) keeping up, by shed: this decision's
        self._since_change = config.cooldown
        self.budget = ErrorBudget(config)
        self.quantile = config.quantile  # the one growing and holding size for (``spend``)

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
        busiest = self.memory.busiest(up_only)
        draining = busiest > 0 and obs.load.rate < c.forget_below * busiest
        stepped = False
        if up_only:
            obs, stepped = self.memory.check(obs)
        else:
            self._since_change += 1
            if not draining:
                self._learn(obs)
            obs = self.memory.close(obs)
            self.quantile = self.budget.quantile(obs)
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
        if self._since_change <= c.cooldown or not self.memory.full():
            return Decision(obs.t, Reason.HOLD, current, now_pred, held)
        recent = self.memory.decisions()  # this one first

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
            self._floor[most] = self.floor(obs, most)
        p, d = self._floor[most]
        if below is not None:
            p, d = min(p, below.prefill), min(d, below.decode)
        return layout.prefill >= p and layout.decode >= d

    def floor(self, obs: Observation, shed: float) -> tuple[int, int]:
        """The keep-up floor (``keep_up.fewest``) of every window remembered and ``obs``, the
        one being decided on, priced at ``obs``."""
        return fewest(self.config, [*self.memory.windows(), obs], obs, self.predict, shed)

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
