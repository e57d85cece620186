"""The pool planner: closed-form capacity against the step-time model, up at once, down slowly
and one worker at a time, switches when the total suffices, no NaNs on an empty window, and no
flapping at a steady load."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.planning.capacity import erlang_c, predict
from pdserve.planning.keep_up import fewest, fewest_passing
from pdserve.planning.planner import Planner
from pdserve.planning.planner_data import Bounds, Decision, Layout, Observation, PlannerConfig, Reason
from pdserve.planning.step_correction import NONE, StepCorrection
from pdserve.router.workload_window import Workload, WorkloadWindow, kept, light_means, prompt_quantile
from pdserve.steptime.roofline import H100_LLAMA3_8B as H100

CONV = (1263.0, 209.0)  # mean prompt and output tokens of a conversation trace
SLO = PlannerConfig(ttft_s=0.25, tpot_s=0.1, bounds=Bounds(1, 8, 1, 8))


def obs(t: float, layout: Layout, rate: float, lens: tuple[float, float] = CONV, **kw: object) -> Observation:
    return Observation(t, layout, Workload(rate, *lens), **kw)  # type: ignore[arg-type]


def test_capacity_grows_with_workers_and_fails_past_saturation() -> None:
    load = Workload(100.0, *CONV)
    few, more = predict(H100, load, 2, 2), predict(H100, load, 6, 6)
    assert not few.feasible and more.feasible
    assert more.ttft_s < 0.25 and more.tpot_s < 0.1
    light = predict(H100, Workload(1.0, *CONV), 1, 1)
    assert light.ttft_s == pytest.approx(H100.prefill_time(1263) + H100.transfer_time(1263), rel=0.01)
    # prefix hits take work off prefill: utilization falls with the cached share
    hit = predict(H100, Workload(100.0, *CONV, cached_share=0.5), 4, 4)
    assert hit.prefill_util < predict(H100, load, 4, 4).prefill_util
    with pytest.raises(ValueError):
        Workload(math.nan, 1, 1)
    with pytest.raises(ValueError):
        predict(H100, load, 0, 1)


def test_a_decode_batch_cap_below_the_kv_pool_bounds_what_a_worker_keeps_up_with() -> None:
    """A decode worker whose step holds at most ``max_seqs`` requests cannot grow its batch to
    what its KV pool holds: the requests past the cap wait for a slot, their gaps unbounded."""
    load = Workload(40.0, *CONV)
    free = predict(H100, load, 4, 1)
    assert free.feasible and free.decode_batch > 64  # the KV pool holds ~300 such requests
    capped = predict(H100, load, 4, 1, max_seqs=64)
    assert capped.tpot_s == math.inf and capped.decode_batch == 64
    # a cap above the fixed point changes nothing
    assert predict(H100, load, 4, 1, max_seqs=1024) == free
    with pytest.raises(ValueError, match="max_seqs"):
        predict(H100, load, 4, 1, max_seqs=0)
    # the planner prices its layouts with the engines' cap: more decode workers for the same load
    seen = obs(0.0, Layout(4, 1), 40.0, requests=400, attainment=0.95)
    free_plan, capped_plan = Planner(H100, SLO), Planner(H100, replace(SLO, max_seqs=64))
    assert capped_plan.predict(seen, Layout(4, 1)).tpot_s == math.inf
    assert free_plan.decide(seen).layout.decode < capped_plan.decide(seen).layout.decode
    with pytest.raises(ValueError, match="max_seqs"):
        replace(SLO, max_seqs=0)


def test_decode_is_sized_on_a_window_as_long_as_a_request_decodes() -> None:
    """A burst past what the decode pool emits, shorter than a request's decode at the TPOT
    target, waits in its batch and queue at a small cost to TPOT: a check grows decode only
    on the longer window's load (``Observation.decode_load``), prefill on its own."""
    p = Planner(H100, SLO)
    assert p.memory.decode_span(10.0, 30.0, 209.0) == pytest.approx(20.9)  # 209 tokens at 100 ms
    assert p.memory.decode_span(30.0, 30.0, 209.0) == 30.0  # never shorter than the window looked at
    assert p.memory.decode_span(10.0, 30.0, 5000.0) == 90.0  # at most the intervals remembered
    assert p.memory.decode_span(10.0, 30.0, 0.0) == 10.0  # nothing arrived
    # one decode worker keeps up with about 52 conversation requests a second
    burst = dict(requests=400, attainment=0.95)
    held = p.decide(obs(10.0, Layout(4, 1), 60.0, decode_load=Workload(40.0, *CONV), **burst), up_only=True)
    assert held.reason is Reason.HOLD and held.predicted.feasible
    sustained = obs(10.0, Layout(4, 1), 60.0, decode_load=Workload(60.0, *CONV), **burst)
    grown = Planner(H100, SLO).decide(sustained, up_only=True)
    assert grown.changes and grown.layout.decode == 2  # a prefill worker switched over
    # the keep-up floor reads the same loads: a prefill pool too short for the burst grows, and
    # decode stays as it is
    short = obs(20.0, Layout(1, 1), 60.0, decode_load=Workload(40.0, *CONV), **burst)
    grown = Planner(H100, SLO).decide(short, up_only=True)
    assert grown.changes and grown.layout.prefill > 1 and grown.layout.decode == 1


def test_the_decode_window_is_read_on_the_longest_window_and_never_before_the_start() -> None:
    p = Planner(H100, SLO)
    asked: list[float] = []

    def over(lens: dict[float, Workload]):  # type: ignore[no-untyped-def]
        def load(s: float) -> Workload:
            asked.append(s)
            return lens.get(s, Workload(30.0, *CONV))

        return load

    # a conversation mix decodes for 20.9 s at 100 ms: read on the 90 s window first
    got = p.memory.decode_window(10.0, 30.0, 1000.0, over({}))
    assert asked == [90.0, pytest.approx(20.9)] and got == Workload(30.0, *CONV)
    asked.clear()
    # long outputs: the longest window itself, read once
    long_out = Workload(5.0, 1000.0, 2000.0)
    assert p.memory.decode_window(10.0, 30.0, 1000.0, over({90.0: long_out})) == long_out and asked == [90.0]
    asked.clear()
    # not before the start: 15 s in, the 10 s check's decode window is 15 s at most
    p.memory.decode_window(10.0, 30.0, 15.0, over({}))
    assert asked == [15.0]
    asked.clear()
    # nothing longer than the look: no second load, decode priced on the look's own
    assert p.memory.decode_window(30.0, 30.0, 25.0, over({})) is None and asked == []
    assert p.memory.decode_window(10.0, 30.0, 1000.0, over({90.0: Workload(0.0, 0.0, 0.0)})) is None


def test_the_prefill_pool_queues_as_one() -> None:
    """The router sends a prompt to the worker done first: one M/D/P queue, whose wait is far
    shorter than P separate M/D/1 queues' at the same utilization (one worker: M/D/1)."""
    assert erlang_c(1, 0.7) == pytest.approx(0.7) and erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(4, 0.0) == 0.0
    chances = [erlang_c(c, 0.9 * c) for c in (1, 2, 8, 32, 64)]
    assert all(0 < x < 1 for x in chances) and chances == sorted(chances, reverse=True)
    s = H100.prefill_time(1263)
    one = predict(H100, Workload(0.85 / s, *CONV), 1, 8)
    pool = predict(H100, Workload(30 * 0.85 / s, *CONV), 30, 24)
    assert pool.prefill_util == pytest.approx(one.prefill_util) == pytest.approx(0.85, rel=1e-3)
    assert pool.ttft_s < 0.5 * one.ttft_s  # ≈ 40 ms against ≈ 240
    assert predict(H100, Workload(30 / s, *CONV), 30, 24).ttft_s == math.inf


def test_a_ttft_quantile_is_the_long_prompts_own_prefill_at_light_load() -> None:
    light = Workload(1.0, *CONV, prompt_tail_tokens=3000.0)
    p = predict(H100, light, 1, 1)
    assert p.ttft_s == pytest.approx(H100.prefill_time(3000) + H100.transfer_time(3000), rel=0.01)
    # utilization is the mean prompt's: the tail sets the quantile, not the load
    assert p.prefill_util == pytest.approx(predict(H100, Workload(1.0, *CONV), 1, 1).prefill_util)
    with pytest.raises(ValueError):
        Workload(1.0, *CONV, prompt_tail_tokens=math.nan)


def test_the_window_measures_rate_means_and_the_prompt_tail() -> None:
    w = WorkloadWindow(horizon_s=60.0)
    for i in range(100):  # ten each of 100, 200, ..., 1000 tokens, 10 a second
        w.arrived(i * 0.1, 100 * (i % 10 + 1), 50)
    for i in range(20):
        w.ended(5.0 + i * 0.1, 400, 100, 30)
    load = w.workload(9.95, 10.0, 0.9)
    assert load.rate == pytest.approx(10.0) and load.prompt_tokens == pytest.approx(550.0)
    assert load.prompt_tail_tokens == 1000.0 and load.output_tokens == 30.0
    assert load.cached_share == pytest.approx(0.25)
    assert w.workload(9.95, 10.0, 0.5).prompt_tail_tokens == 600.0
    assert w.workload(500.0, 10.0) == Workload(0.0, 0.0, 0.0, span_s=10.0)  # nothing in it: zeros, no NaN
    assert prompt_quantile([], 0.9) == 0.0
    # a window longer than what is kept is a rate over what is kept, not a lull: past the
    # horizon, and past the entry cap under a heavy load
    assert w.workload(9.95, 600.0).rate == pytest.approx(100 / 60.0)
    capped = WorkloadWindow(horizon_s=600.0, max_entries=50)
    for i in range(100):
        capped.arrived(i * 0.1, 100, 50)
    assert capped.workload(9.95, 60.0).rate == pytest.approx(10.0, rel=0.03)
    for bad in (0.0, 1.0, math.nan):
        with pytest.raises(ValueError):
            prompt_quantile([1], bad)


def test_a_load_step_scales_up_at_once_then_down_after_several_intervals() -> None:
    plan = Planner(H100, SLO)
    layout = Layout(1, 1)
    d = plan.decide(obs(0, layout, 5.0))
    assert d.reason is Reason.HOLD
    d = plan.decide(obs(30, layout, 100.0))  # a step: decided in the same interval
    assert d.reason is Reason.SCALE_UP and d.layout.workers > 2
    assert d.predicted.ttft_s <= 0.25 and d.predicted.tpot_s <= 0.1
    layout = d.layout
    reasons = []
    for i in range(30):  # the load falls back
        d = plan.decide(obs(60 + 30 * i, layout, 5.0))
        reasons.append(d.reason)
        if d.reason is Reason.SCALE_DOWN:  # only stops workers, each pool within what it had
            assert d.layout.prefill <= layout.prefill and d.layout.decode <= layout.decode
            assert d.layout.workers < layout.workers
        layout = d.layout
    assert layout == Layout(1, 1)
    first_down = reasons.index(Reason.SCALE_DOWN)
    assert first_down >= SLO.down_after - 1  # not on the first quiet interval
    downs = [i for i, r in enumerate(reasons) if r is Reason.SCALE_DOWN]
    assert all(b - a > SLO.cooldown for a, b in itertools.pairwise(downs))


def test_steady_load_does_not_flap() -> None:
    plan = Planner(H100, SLO)
    layout = Layout(1, 1)
    changes = []
    for i in range(40):
        rate = 60.0 * (1 + 0.05 * math.sin(i))  # steady, with noise
        d = plan.decide(obs(30 * i, layout, rate, requests=1000, attainment=0.97, ttft_s=0.12, tpot_s=0.02))
        if d.changes:
            changes.append(i)
        layout = d.layout
    settled = [i for i in changes if i >= 10]
    assert len(settled) <= 1  # at most one change once settled (2 -> 1 -> 2 is what it must not do)


def test_zero_traffic_goes_to_the_minimum_without_nans() -> None:
    plan = Planner(H100, PlannerConfig(0.25, 0.1, Bounds(2, 6, 1, 6)))
    # learned under an overload: an idle worker would look busy
    plan.correction = StepCorrection(50.0, 50.0, 1.0)
    layout = Layout(6, 6)
    for i in range(80):
        d = plan.decide(obs(30 * i, layout, 0.0, lens=(0.0, 0.0)))
        assert math.isfinite(d.predicted.ttft_s) and math.isfinite(d.predicted.tpot_s)
        layout = d.layout
    assert layout == Layout(2, 1)


def test_a_shift_toward_long_prompts_switches_a_worker_instead_of_adding_one() -> None:
    plan = Planner(H100, SLO)
    layout = Layout(2, 6)
    d = plan.decide(obs(0, layout, 40.0, lens=(600.0, 400.0)))
    assert d.reason is Reason.HOLD
    d = plan.decide(obs(30, layout, 40.0, lens=(2500.0, 60.0)))  # long prompts, short answers
    assert d.reason is Reason.SWITCH and d.layout.workers == 8 and d.layout.prefill > 2


def test_measured_misses_grow_the_pools_even_when_the_model_is_optimistic() -> None:
    plan = Planner(H100, SLO)
    layout = Layout(4, 4)
    d = plan.decide(obs(0, layout, 20.0, requests=500, attainment=0.6, ttft_s=0.9, tpot_s=0.05))
    assert d.reason is Reason.SCALE_UP and d.layout.workers > 8 - 0
    assert plan.correction.prefill > 1.0  # it learned the model was optimistic about TTFT


def test_a_window_where_every_request_missed_is_a_miss() -> None:
    plan = Planner(H100, SLO)
    d = plan.decide(obs(0, Layout(4, 4), 20.0, requests=500, attainment=0.0, ttft_s=3.0, tpot_s=0.05))
    assert d.reason is Reason.SCALE_UP and d.layout.workers > 8


def test_warming_workers_hold_the_layout_and_teach_nothing() -> None:
    plan = Planner(H100, SLO)
    d = plan.decide(obs(0, Layout(2, 2), 30.0, requests=500, attainment=0.2, ttft_s=5.0, warming=True))
    assert d.reason is Reason.WARMING and d.layout == Layout(2, 2) and plan.correction == NONE
    # the load kept rising while they started: what arrives still grows the pools, at once
    d = plan.decide(obs(10, Layout(2, 2), 100.0, requests=500, attainment=0.0, ttft_s=9.0, warming=True))
    assert d.reason is Reason.SCALE_UP and d.layout.workers > 4 and plan.correction == NONE
    assert d.predicted.ttft_s <= 0.25 and "predicted" in d.detail


def test_an_overloaded_layouts_queue_teaches_the_model_nothing() -> None:
    """Tails measured while the model sees the layout unable to keep up (here its one decode
    worker; its prefill TTFT is finite) are a queue's length, not the model's error: neither
    correction moves, so the scale-up is sized by the load."""
    layout = Layout(4, 1)
    raw = Planner(H100, SLO).predict(obs(0, layout, 55.0), layout)
    assert math.isfinite(raw.ttft_s) and not raw.feasible
    plan = Planner(H100, SLO)
    d = plan.decide(obs(0, layout, 55.0, requests=500, attainment=0.0, ttft_s=30.0, tpot_s=2.0))
    assert d.reason in (Reason.SCALE_UP, Reason.SWITCH) and plan.correction == NONE
    assert d.layout == Planner(H100, SLO).decide(obs(0, layout, 55.0)).layout


def test_nothing_fits_goes_to_the_bounds_once() -> None:
    plan = Planner(H100, PlannerConfig(0.25, 0.1, Bounds(1, 2, 1, 2)))
    d = plan.decide(obs(0, Layout(1, 1), 500.0))
    assert d.reason is Reason.OVERLOADED and d.layout == Layout(2, 2)
    d = plan.decide(obs(30, d.layout, 500.0))
    assert d.reason is Reason.HOLD and "at the bounds" in d.detail


def test_bad_config_is_refused() -> None:
    for shed in (-0.01, 1e-10, 0.1, math.nan):  # a share too small to measure, or all the misses
        with pytest.raises(ValueError, match="shed"):
            PlannerConfig(0.25, 0.1, shed=shed)
    assert PlannerConfig(0.25, 0.1, shed=0.001).shares[-1] == 0.999
    with pytest.raises(ValueError):
        Bounds(2, 1, 1, 1)
    with pytest.raises(ValueError):
        PlannerConfig(0.0, 0.1)
    with pytest.raises(ValueError):
        PlannerConfig(0.25, 0.1, margin=0.0)


def test_a_check_between_decisions_grows_only_on_what_is_certain() -> None:
    """A short window's burst that only pushes a predicted tail over the target waits for the
    decision; a load the layout cannot keep up with at all, or a measured miss, grows at once."""
    plan = Planner(H100, SLO)
    layout = Layout(3, 2)
    tight = next(
        r
        for r in (x / 2 for x in range(2, 400))
        if not plan._meets(plan.predict(obs(0, layout, r), layout), 1.0)
    )
    assert plan.predict(obs(0, layout, tight), layout).feasible  # over the target, still keeping up
    d = plan.decide(obs(10, layout, tight), up_only=True)
    assert d.reason is Reason.HOLD and d.layout == layout
    d = plan.decide(obs(20, layout, tight, requests=500, attainment=0.5), up_only=True)
    assert d.reason is Reason.SCALE_UP
    plan = Planner(H100, SLO)
    assert plan.decide(obs(10, layout, 200.0), up_only=True).reason in (Reason.SCALE_UP, Reason.OVERLOADED)
    assert Planner(H100, SLO).decide(obs(30, layout, tight)).reason is Reason.SCALE_UP  # the decision acts


def test_a_check_on_a_step_grows_on_a_predicted_miss() -> None:
    """A check window far busier than every window remembered is a step, not a burst: a tail
    predicted over the target grows the pools then, without waiting for the misses to be
    measured or for the decision; a burst over a steady load that is just as tight waits."""
    layout = Layout(3, 2)
    probe = Planner(H100, SLO)
    tight = next(
        r
        for r in (x / 2 for x in range(2, 400))
        if not probe._meets(probe.predict(obs(0, layout, r), layout), 1.0)
    )
    assert probe.predict(obs(0, layout, tight), layout).feasible

    def after(rate: float) -> Planner:
        plan = Planner(H100, SLO)
        for i in range(2):  # two intervals remembered (a third would step the idle pools down)
            for k in (1, 2):
                assert not plan.decide(obs(30 * i + 10 * k, layout, rate), up_only=True).changes
            assert not plan.decide(obs(30 * i + 30, layout, rate)).changes
        return plan

    d = after(tight / 4).decide(obs(100, layout, tight), up_only=True)
    assert d.reason is Reason.SCALE_UP and d.layout.workers > layout.workers, d
    assert "predicted TTFT" in d.detail
    # the same window over a load a fifth lighter: a burst, for the decision to judge
    assert after(tight / 1.2).decide(obs(100, layout, tight), up_only=True).reason is Reason.HOLD
    # and never on the planner's first interval, with nothing remembered to compare
    assert Planner(H100, SLO).decide(obs(10, layout, tight), up_only=True).reason is Reason.HOLD
    with pytest.raises(ValueError, match="step_above"):
        PlannerConfig(0.25, 0.1, step_above=1.0)


def test_a_check_between_decisions_restores_the_bounds() -> None:
    """A lost worker (or a raised minimum) is replaced at the next look, not the next decision."""
    plan = Planner(H100, PlannerConfig(0.25, 0.1, Bounds(2, 6, 1, 6)))
    d = plan.decide(obs(10, Layout(1, 1), 1.0), up_only=True)
    assert d.reason is Reason.SCALE_UP and d.layout == Layout(2, 1) and "bounds" in d.detail


def test_the_way_down_keeps_up_with_the_bursts_the_checks_saw() -> None:
    """At a steady mean with 10 s windows a third busier (a large cluster replaying a trace
    sees that), a layout chosen on the way down must keep up with those windows: otherwise the
    next check grows the pools again and the planner cycles down and up."""
    plan = Planner(H100, PlannerConfig(0.25, 0.1, Bounds(1, 40, 1, 24)))
    layout, changes = Layout(40, 24), []
    for i in range(60):
        for k in (1, 2):  # the two checks between decisions see the bursts
            d = plan.decide(obs(30 * i + 10 * k, layout, 650.0 * (1.3 if k == 1 else 1.0)), up_only=True)
            if d.changes:
                changes.append(i)
                layout = d.layout
        # the tails measured are about the model's (a step-time factor far off would be a slower
        # cluster, whose smaller layouts do not keep up)
        d = plan.decide(
            obs(30 * i + 30, layout, 650.0, requests=5000, attainment=0.98, ttft_s=0.035, tpot_s=0.013)
        )
        if d.changes:
            changes.append(i)
            layout = d.layout
    assert changes and layout.workers < 64  # it did come down from the top
    settled = [i for i in changes if i >= 30]
    assert not settled, changes
    assert predict(H100, Workload(650.0 * 1.3, *CONV), layout.prefill, layout.decode).feasible


# A heavy-tailed prompt mix as a conversation trace has it: the longest tenth of the prompts
# carries about a third of the prefill.
HEAVY = [300.0] * 60 + [1000.0] * 30 + [4000.0] * 10
SHED = PlannerConfig(ttft_s=0.25, tpot_s=0.1, bounds=Bounds(1, 8, 1, 8), shed=0.08)


def heavy(t: float, layout: Layout, rate: float, config: PlannerConfig = SHED, **kw: object) -> Observation:
    ordered = sorted(HEAVY)
    load = Workload(
        rate,
        sum(HEAVY) / len(HEAVY),
        200.0,
        0.0,
        prompt_quantile(ordered, 0.9),
        light_means(ordered, config.shares),
    )
    return Observation(t, layout, load, **kw)  # type: ignore[arg-type]


def test_the_window_measures_the_light_share_means() -> None:
    w = WorkloadWindow(horizon_s=60.0)
    for i, p in enumerate(HEAVY):
        w.arrived(i * 0.1, int(p), 50)
    load = w.workload(9.95, 10.0, 0.9, (0.95, 0.9))
    assert load.light == (
        (0.95, pytest.approx((60 * 300 + 30 * 1000 + 5 * 4000) / 95)),
        (0.9, pytest.approx(48000 / 90)),
    )
    assert (
        load.light_prompt_tokens(0.9) == pytest.approx(48000 / 90)
        and load.light_prompt_tokens(1.0) == load.prompt_tokens
    )
    with pytest.raises(ValueError, match="not measured"):
        load.light_prompt_tokens(0.8)
    # at least the share is kept: a small window refuses no more than the share allows
    assert kept(0, 0.5) == 0 and kept(3, 0.1) == 1 and kept(10, 0.95) == 10 and kept(100, 0.95) == 95
    assert light_means([], (0.9,)) == ((0.9, 0.0),)
    for bad in ((1.0, 1.0), (0.5, math.nan), (0.5, 5000.0)):  # a share of all, NaN, over the mean
        with pytest.raises(ValueError):
            Workload(1.0, 1000.0, 1.0, light=(bad,))


def test_refusing_the_heaviest_prompts_frees_the_prefill_pool_not_decode() -> None:
    load = heavy(0, Layout(1, 1), 200.0).load
    everyone = predict(H100, load, 3, 4)
    refusing = predict(H100, load, 3, 4, admitted=0.92)
    assert not everyone.feasible and refusing.feasible and refusing.admitted == 0.92
    assert refusing.prefill_util < 0.8 * everyone.prefill_util
    assert refusing.tpot_s == everyone.tpot_s  # decode is priced for every arrival
    # the kept requests must meet at a higher quantile of their own: its wait is longer than
    # the same load's at the plain quantile
    kept_load = replace(load, rate=load.rate * 0.92, prompt_tokens=load.light_prompt_tokens(0.92), light=())
    assert refusing.ttft_s > predict(H100, kept_load, 3, 4).ttft_s
    for bad in (0.9, 0.85, 1.01):  # at or under the quantile: the SLO cannot be met by refusing
        with pytest.raises(ValueError):
            predict(H100, load, 3, 4, admitted=bad)
    with pytest.raises(ValueError, match="not measured"):
        predict(H100, load, 3, 4, admitted=0.93)


def test_refusals_are_counted_on_to_hold_and_on_a_tail_miss_never_through_a_queue_or_down() -> None:
    full_config = replace(SHED, shed=0.0)

    def pair() -> tuple[Planner, Planner]:
        return Planner(H100, SHED), Planner(H100, full_config)

    # a load step the layout cannot keep up with even refusing: sized to serve every request
    plan, full = pair()
    step, step_full = (
        plan.decide(heavy(0, Layout(1, 1), 200.0)),
        full.decide(heavy(0, Layout(1, 1), 200.0, full_config)),
    )
    assert step.reason is Reason.SCALE_UP and step.layout == step_full.layout == Layout(5, 4)
    # a layout that meets only by refusing the heaviest prompts holds (serving all, it grows)
    plan, full = pair()
    assert plan.decide(heavy(0, Layout(4, 4), 200.0)).reason is Reason.HOLD
    assert full.decide(heavy(0, Layout(4, 4), 200.0, full_config)).reason is Reason.SCALE_UP
    # a measured tail miss on a layout that keeps up by refusing: one more worker, refusals counted
    plan, _ = pair()
    d = plan.decide(heavy(0, Layout(3, 4), 200.0, requests=6000, attainment=0.85, ttft_s=0.24, tpot_s=0.02))
    assert d.reason is Reason.SCALE_UP and d.layout == Layout(4, 4) and d.predicted.admitted < 1
    # the way down serves every request: from 7P+4D it stops at 5P+4D, never at 4P or 3P
    plan, _ = pair()
    layout, seen = Layout(7, 4), []
    for i in range(30):
        for k in (1, 2):
            plan.decide(heavy(30 * i + 10 * k, layout, 200.0), up_only=True)
        d = plan.decide(
            heavy(30 * i + 30, layout, 200.0, requests=6000, attainment=0.97, ttft_s=0.12, tpot_s=0.02)
        )
        seen.append(d.layout)
        layout = d.layout
    assert layout == Layout(5, 4) and min(l.prefill for l in seen) == 5


def test_a_miss_the_model_does_not_see_grows_the_pool_its_tails_blame() -> None:
    layout = Layout(2, 2)
    slow_first = Planner(H100, SLO).decide(
        obs(0, layout, 10.0, requests=500, attainment=0.8, ttft_s=0.24, tpot_s=0.02)
    )
    assert slow_first.reason is Reason.SCALE_UP and slow_first.layout == Layout(3, 2)
    slow_tokens = Planner(H100, SLO).decide(
        obs(0, layout, 10.0, requests=500, attainment=0.8, ttft_s=0.05, tpot_s=0.09)
    )
    assert slow_tokens.reason is Reason.SCALE_UP and slow_tokens.layout == Layout(2, 3)
    nothing_served = Planner(H100, SLO).decide(obs(0, layout, 10.0, requests=500, attainment=0.0))
    assert nothing_served.reason is Reason.SCALE_UP and nothing_served.layout == Layout(3, 2)


def test_a_pool_short_of_its_floor_does_not_hold_the_others_idle_workers() -> None:
    """Decode bursts (checks) ask for more decode workers than the layout has, without a miss;
    an idle prefill pool still steps down."""
    plan = Planner(H100, SLO)
    layout = Layout(6, 2)
    steps = []
    for i in range(12):
        for k in (1, 2):  # short windows 1.8x as busy: two decode workers keep up, not with headroom
            plan.decide(obs(30 * i + 10 * k, layout, 180.0, lens=(100.0, 300.0)), up_only=True)
        d = plan.decide(obs(30 * i + 30, layout, 100.0, lens=(100.0, 300.0), requests=3000, attainment=0.99))
        steps += [d.layout] if d.reason is Reason.SCALE_DOWN else []
        layout = d.layout
    assert plan.floor(obs(400, layout, 100.0, lens=(100.0, 300.0)), 0.0)[1] > 2  # decode short of its floor
    assert steps and layout.prefill < 6 and layout.decode == 2


def test_the_keep_up_headroom_shrinks_with_the_window_length() -> None:
    """A 90 s decode window is already most of a burst: a tenth over its rate asks for a decode
    worker that a third of that (10 % / sqrt(9)) does not; a window of unknown length, or no
    longer than the checks', keeps the whole headroom."""
    cap = replace(SLO, max_seqs=256)
    plan = Planner(H100, cap)

    def one_keeps_up(rate: float) -> bool:
        load = Workload(rate, *CONV)
        return math.isfinite(
            plan.predict(obs(0, Layout(8, 1), rate, decode_load=load), Layout(8, 1), 0.0).tpot_s
        )

    lo, hi = 1.0, 200.0  # the most one decode worker keeps up with
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if one_keeps_up(mid) else (lo, mid)
    rate = lo / 1.045  # within 10 / sqrt(3) % of the edge, more than 10 / 3 % from it
    assert not one_keeps_up(rate * (1 + 0.1 / math.sqrt(3))) and one_keeps_up(rate * (1 + 0.1 / 3))

    def decode_floor(span_s: float, config: PlannerConfig = cap) -> int:
        window = obs(30.0, Layout(1, 1), 5.0, decode_load=Workload(rate, *CONV, span_s=span_s))
        return fewest(config, [window], window, Planner(H100, config).predict, 0.0)[1]

    assert decode_floor(90.0) == 1
    assert decode_floor(0.0) == decode_floor(10.0) == decode_floor(5.0) == 2
    # sized for 30 s checks (a 90 s interval), a 90 s window keeps 10 / sqrt(3) %: still two
    assert decode_floor(90.0, replace(cap, headroom_span_s=30.0)) == 2
    with pytest.raises(ValueError, match="headroom_span_s"):
        replace(cap, headroom_span_s=0.0)
    with pytest.raises(ValueError, match="span_s"):
        Workload(1.0, *CONV, span_s=math.nan)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100_000), max_size=300), st.lists(st.floats(0.5, 1.0), min_size=1, max_size=5))
def test_a_lighter_share_never_has_a_heavier_mean(prompts: list[int], shares: list[float]) -> None:
    ordered = sorted(float(p) for p in prompts)
    mean = math.fsum(ordered) / len(ordered) if ordered else 0.0
    means = dict(light_means(ordered, sorted(set(shares))))
    for share, m in means.items():
        assert kept(len(ordered), share) >= share * len(ordered) - 1e-6  # never refuses beyond it
        assert m <= mean * (1 + 1e-12)
    by_share = [means[a] for a in sorted(means)]
    assert all(a <= b * (1 + 1e-12) for a, b in itertools.pairwise(by_share))


def test_the_error_budget_is_banked_by_good_windows_and_spent_growing_not_going_down() -> None:
    spend = replace(SLO, spend=0.5, budget_intervals=4)
    plan, strict = Planner(H100, spend), Planner(H100, SLO)
    layout = Layout(2, 2)
    good = {"requests": 1000, "attainment": 0.99, "ttft_s": 0.1, "tpot_s": 0.02}
    for i in range(4):  # four windows 9 points over: a bank of 360 met requests beyond 0.9
        plan.decide(obs(30 * i, layout, 20.0, **good))  # type: ignore[arg-type]
        strict.decide(obs(30 * i, layout, 20.0, **good))  # type: ignore[arg-type]
    # half the bank over the next ~1000 requests: 18 points below, capped at the SLO's own 10
    assert plan.quantile == pytest.approx(0.8) and strict.quantile == 0.9
    # a window at 0.85 is within what the budget allows: held, where the strict planner grows
    miss = {"requests": 1000, "attainment": 0.85, "ttft_s": 0.2, "tpot_s": 0.02}
    d = plan.decide(obs(120, layout, 20.0, **miss))  # type: ignore[arg-type]
    assert d.reason is Reason.HOLD and "spending the error budget" in d.detail
    assert strict.decide(obs(120, layout, 20.0, **miss)).reason is Reason.SCALE_UP  # type: ignore[arg-type]
    # misses empty the bank (the oldest good window leaves it too): sized for 0.9 again
    for i in range(3):
        plan.decide(obs(150 + 30 * i, layout, 20.0, requests=1000, attainment=0.7, ttft_s=0.4, tpot_s=0.02))
    assert plan.quantile == 0.9


def test_spending_is_off_by_default_and_checked() -> None:
    plan = Planner(H100, SLO)
    plan.decide(obs(0, Layout(2, 2), 20.0, requests=1000, attainment=1.0, ttft_s=0.1, tpot_s=0.02))
    assert plan.quantile == SLO.quantile and SLO.spend == 0.0
    for bad in ({"spend": -0.1}, {"spend": 1.5}, {"spend": math.nan}, {"budget_intervals": 0}):
        with pytest.raises(ValueError):
            replace(SLO, **bad)  # type: ignore[arg-type]


def test_a_quiet_or_idle_stretch_does_not_inflate_the_budget() -> None:
    plan = Planner(H100, replace(SLO, spend=0.5, budget_intervals=4))
    layout = Layout(2, 2)
    busy = {"requests": 1000, "attainment": 0.92, "ttft_s": 0.1, "tpot_s": 0.02}
    plan.decide(obs(0, layout, 30.0, **busy))  # type: ignore[arg-type]
    plan.decide(obs(30, layout, 1.0, requests=20, attainment=1.0, ttft_s=0.1, tpot_s=0.02))
    # a bank of 22 spent over a busy window's 1000 requests, not the quiet one's 20
    assert plan.quantile == pytest.approx(0.9 - 0.5 * 22 / 1000)
    for i in range(4):  # idle windows: nothing banked, and the old surplus ages out
        plan.decide(obs(60 + 30 * i, layout, 0.0, lens=(0.0, 0.0)))
    assert plan.quantile == 0.9


def test_a_queue_building_is_sized_for_the_slo_not_the_budget() -> None:
    spend = Planner(H100, replace(SLO, spend=1.0))
    strict = Planner(H100, SLO)
    layout = Layout(2, 2)
    for plan in (spend, strict):
        for i in range(5):
            plan.decide(obs(30 * i, layout, 5.0, requests=1000, attainment=0.99))
    assert spend.quantile == pytest.approx(0.8)
    step = obs(150, layout, 150.0, requests=1000, attainment=0.99)
    grown, expected = spend.decide(step), strict.decide(step)
    assert grown.reason is Reason.SCALE_UP and grown.layout == expected.layout
    assert spend.quantile == 0.9 and "spending" not in grown.detail


def _step_then_fall(config: PlannerConfig, low: float = 5.0) -> tuple[list[Reason], list[str]]:
    """A step to 100 req/s held for six intervals (every check window there a third busier
    once in three), then the load falls to ``low``; the reasons of the decisions after the fall."""
    plan = Planner(H100, config)
    layout = Layout(1, 1)
    reasons, details = [], []
    for i in range(16):
        rate = 100.0 if 1 <= i <= 6 else (5.0 if i == 0 else low)
        for k in (1, 2):
            d = plan.decide(obs(30 * i + 10 * k, layout, rate * (1.3 if k == 1 else 1.0)), up_only=True)
            layout = d.layout
        d = plan.decide(obs(30 * i + 30, layout, rate))
        layout = d.layout
        if i > 6:
            reasons.append(d.reason)
            details.append(d.detail)
    return reasons, details


def test_a_fall_of_the_load_restarts_the_memory_and_the_pools_step_down_at_once() -> None:
    fast, details = _step_then_fall(SLO)
    slow, _ = _step_then_fall(replace(SLO, forget_below=0.0))
    assert fast[0] is Reason.SCALE_DOWN  # the first decision after the fall
    assert "since the load fell" in details[0]
    assert slow.index(Reason.SCALE_DOWN) == SLO.down_after - 1  # the step's windows held it
    # a fall to just over half the busiest window remembered is not one: held as before
    partial, _ = _step_then_fall(SLO, low=70.0)
    assert Reason.SCALE_DOWN not in partial[: SLO.down_after - 1]


def test_a_bursty_steady_load_never_restarts_the_memory() -> None:
    """A steady load whose quietest 10 s windows carry 0.4 of its busiest (a bursty trace has
    such lulls) keeps the memory: only a whole interval under the share is a fall, and the
    pools come down from the top by the ordinary rule only."""
    plan = Planner(H100, SLO)
    layout, details = Layout(8, 8), []
    for i in range(20):
        for k, share in ((1, 0.4), (2, 1.0)):
            layout = plan.decide(obs(30 * i + 10 * k, layout, 100.0 * share), up_only=True).layout
        d = plan.decide(obs(30 * i + 30, layout, 80.0))
        details.append(d.detail)
        layout = d.layout
    assert layout.workers < 16  # it did come down
    assert not [x for x in details if "fell" in x], details


def test_forget_below_is_a_share() -> None:
    for bad in (-0.1, 1.0, math.nan):
        with pytest.raises(ValueError, match="forget_below"):
            PlannerConfig(0.25, 0.1, forget_below=bad)


def test_a_gradual_decline_is_measured_against_what_stays_remembered() -> None:
    """100 -> 70 -> 55 -> 45 req/s: at 45 the 100 interval leaves the memory anyway, and 45 is
    not under half of the 70 that stays, so nothing is forgotten (the floor keeps 70's windows)."""
    plan = Planner(H100, SLO)
    layout, details = Layout(8, 8), []
    for i, rate in enumerate((100.0, 100.0, 100.0, 70.0, 55.0, 45.0)):
        d = plan.decide(obs(30 * i + 30, layout, rate))
        details.append(d.detail)
        layout = d.layout
    assert not [x for x in details if "fell" in x], details
    assert len(plan.memory.intervals) == SLO.down_after


def test_misses_measured_on_a_draining_backlog_grow_nothing_and_teach_nothing() -> None:
    """A step's queue ends after the load fell: its misses are of requests the busier load
    queued. Growing on them starts workers for a backlog already draining; learning from them
    prices the quieter load as the busier one. The model's own prediction still grows."""

    def after_step(
        low: float, config: PlannerConfig = SLO, layout: Layout | None = None, high: float = 60.0
    ) -> tuple[Planner, Decision, Decision]:
        layout = layout or Layout(4, 4)
        plan = Planner(H100, config)
        for t in (10, 20):
            plan.decide(obs(t, layout, high), up_only=True)
        plan.decide(obs(30, layout, high))
        miss = {"requests": 400, "attainment": 0.7, "ttft_s": 0.6, "tpot_s": 0.05}
        check = plan.decide(obs(40, layout, low, **miss), up_only=True)  # type: ignore[arg-type]
        return plan, check, plan.decide(obs(60, layout, low, **miss))  # type: ignore[arg-type]

    plan, check, d = after_step(10.0)
    assert check.reason is Reason.HOLD and "backlog" in check.detail, check
    # nor a decision to step down in (the memory restarted at this fall: it would, measuring 1.0)
    assert d.reason is Reason.HOLD and "backlog" in d.detail and plan.correction == NONE, d
    layout = Layout(4, 4)
    d = plan.decide(obs(90, layout, 10.0, requests=400, attainment=0.7, ttft_s=0.6, tpot_s=0.05))
    assert d.reason is Reason.SCALE_UP, d  # the fall is an interval old: misses are this load's again
    # the same windows without the rule (0: never draining) grow at the check, and learn
    plan, check, d = after_step(10.0, replace(SLO, forget_below=0.0))
    assert check.reason is Reason.SCALE_UP and plan.correction.prefill > 1.0
    # a load that fell to just over half is not draining: its misses are this layout's
    _, check, _ = after_step(40.0)
    assert check.reason is Reason.SCALE_UP
    # a fallen load the layout is predicted unable to serve still grows it
    one = Layout(1, 1)
    assert not Planner(H100, SLO).predict(obs(0, one, 45.0), one).feasible
    _, check, _ = after_step(45.0, layout=one, high=100.0)
    assert check.reason is Reason.SCALE_UP and "predicted" in check.detail, check


def test_a_steady_load_with_one_burst_window_an_interval_is_never_draining() -> None:
    """Two quiet 10 s windows and a busy one every interval: the decisions' 30 s means are
    steady (measured against the intervals' own windows, not the burst), so their misses grow
    the pools and teach the corrections."""
    plan = Planner(H100, SLO)
    layout = Layout(2, 2)
    grew = []
    for i in range(4):
        for k, rate in ((1, 8.0), (2, 30.0)):
            plan.decide(obs(30 * i + 10 * k, layout, rate), up_only=True)
        d = plan.decide(obs(30 * i + 30, layout, 11.7, requests=300, attainment=0.7, ttft_s=0.6, tpot_s=0.05))
        assert "backlog" not in d.detail, d
        grew.append(d.reason is Reason.SCALE_UP)
    assert all(grew) and plan.correction.prefill > 1.0


def test_a_worker_slower_than_its_profile_is_priced_slower_at_the_peak_too() -> None:
    """What the measured tails teach is a factor on the step time, not on the tail: workers 30 %
    slower than the profile, measured in a trough, cannot keep up with a load that the profile
    puts at 83 % of one prefill worker, and the first check that sees that load grows the pool
    (priced as the profile's times a tail ratio it met its target, and only the next decision,
    on a measured miss, would have grown it)."""
    slow = (1.3, 1.0)
    plan = Planner(H100, SLO)
    layout = Layout(1, 2)
    for i in range(8):
        window = obs(30 * i, layout, 5.0)
        truth = predict(H100, window.load, 1, 2, 0.9, slow)
        plan.decide(replace(window, requests=150, attainment=1.0, ttft_s=truth.ttft_s, tpot_s=truth.tpot_s))
    assert plan.correction.prefill == pytest.approx(1.3, rel=0.02)
    assert plan.correction.decode == pytest.approx(1.0, rel=0.02) and plan.correction.decode_fixed_s < 1e-4
    peak = obs(250, layout, 28.0)
    assert plan._meets(predict(H100, peak.load, 1, 2), 1.0)  # the profile alone: one worker meets
    assert not predict(H100, peak.load, 1, 2, 0.9, slow).feasible  # the workers measured: a queue
    d = plan.decide(peak, up_only=True)
    assert d.reason in (Reason.SCALE_UP, Reason.SWITCH) and d.layout.prefill >= 2, d
    assert predict(H100, peak.load, d.layout.prefill, d.layout.decode, 0.9, slow).feasible


def test_the_correction_is_bounded_and_ignores_what_it_cannot_learn_from() -> None:
    plan = Planner(H100, SLO)
    layout = Layout(1, 2)
    plan.decide(obs(0, layout, 5.0, requests=150, attainment=1.0, ttft_s=1e9, tpot_s=1e-40))
    assert 1.0 < plan.correction.prefill <= 2.5  # half the way to 4
    assert plan.correction.decode == 1.0 and plan.correction.decode_fixed_s == 0.0  # never below the model
    before = plan.correction
    plan.decide(obs(30, layout, 5.0, requests=150, attainment=1.0, ttft_s=math.nan, tpot_s=math.inf))
    plan.decide(obs(60, layout, 5.0, requests=5, attainment=1.0, ttft_s=9.0, tpot_s=9.0))  # too few
    plan.decide(obs(90, layout, 500.0, requests=150, attainment=0.0, ttft_s=9.0, tpot_s=9.0))  # a queue
    assert plan.correction == before


def test_serve_and_simulate_size_the_headroom_for_their_checks() -> None:
    """``--autoscale-interval`` sets the window the headroom is sized for: the interval over the
    looks each takes; an unusable interval (serve refuses it first) leaves the default."""
    import argparse

    from pdserve.planning.planner_data import CHECKS
    from pdserve.planning.settings import planner_settings

    def args(interval: float | None) -> argparse.Namespace:
        ns = argparse.Namespace(min_prefill=1, max_prefill=4, min_decode=1, max_decode=4)
        if interval is not None:
            ns.autoscale_interval = interval
        return ns

    assert planner_settings(args(60.0), 0.25, 0.1, False, 256).headroom_span_s == 60.0 / CHECKS
    for bad in (None, math.inf, math.nan, 0.0):
        assert planner_settings(args(bad), 0.25, 0.1, False, 256).headroom_span_s == 10.0


def _fall_with_decode_windows(plan: Planner) -> Decision:
    """100 req/s for four intervals on 4P+3D (what it needs), then 5 req/s; every look carries
    a decode window of 90 s (``Observation.decode_load``) holding the arrivals it spans. The
    first decision after the fall."""
    layout, high, low = Layout(4, 3), 100.0, 5.0

    def look(t: float, span: float) -> Observation:
        before = min(90.0, max(0.0, 120.0 - (t - 90.0)))  # seconds of the window at the high rate
        wide = Workload((high * before + low * (90.0 - before)) / 90.0, *CONV, span_s=90.0)
        rate = high if t <= 120.0 else low
        return Observation(t, layout, Workload(rate, *CONV, span_s=span), decode_load=wide)

    d: Decision | None = None
    for i in range(6):  # the fall is at 120 s
        for k in (1, 2):
            layout = plan.decide(look(30 * i + 10 * k, 10.0), up_only=True).layout
        d = plan.decide(look(30 * i + 30, 30.0))
        layout = d.layout
        if 30 * i + 30 > 120:
            return d
    raise AssertionError("no decision after the fall")


def test_after_a_fall_decode_is_priced_on_what_arrived_since() -> None:
    """A decode window reaching before a fall counts the fallen load as still arriving: it held
    decode workers a window's length after the fall, while the workers stepped down drain their
    own requests. The fall's interval prices decode on its own windows, and the decode windows
    after it reach no further back than the fall."""
    plan = Planner(H100, SLO)
    d = _fall_with_decode_windows(plan)
    assert d.reason is Reason.SCALE_DOWN and "since the load fell" in d.detail, d
    assert d.layout.decode == 1, d
    assert plan.predict(obs(0, d.layout, 5.0), d.layout).feasible
    # the decode window of a look 40 s after the fall began reads those 40 s at most
    asked: list[float] = []

    def over(s: float) -> Workload:
        asked.append(s)
        return Workload(5.0, *CONV, span_s=s)

    plan.memory.decode_window(10.0, 30.0, 1000.0, over, now=160.0)
    assert asked[0] == pytest.approx(40.0) and max(asked) <= 40.0
    # without the clock, as before: the longest window
    asked.clear()
    plan.memory.decode_window(10.0, 30.0, 1000.0, over)
    assert asked[0] == 90.0


def test_at_a_step_decode_is_priced_on_what_arrived_since() -> None:
    """A decode window reaching before a step averages it with the quiet before: it priced one
    decode worker for a 4x load, whose full KV pool then stalled the prefill hand-offs. The
    step's check prices decode on its own window, and the decode windows after it reach no
    further back than the step."""
    low, high, layout = 20.0, 80.0, Layout(2, 1)
    plan = Planner(H100, SLO)

    def look(t: float, span: float) -> Observation:  # on whatever layout the planner holds
        at_high = min(90.0, max(0.0, t - 120.0))  # seconds of a 90 s window after the step at 120 s
        wide = Workload((high * at_high + low * (90.0 - at_high)) / 90.0, *CONV, span_s=90.0)
        rate = high if t > 120.0 else low
        return Observation(t, layout, Workload(rate, *CONV, span_s=span), decode_load=wide)

    for i in range(4):
        for k in (1, 2):
            layout = plan.decide(look(30 * i + 10 * k, 10.0), up_only=True).layout
        layout = plan.decide(look(30 * i + 30, 30.0)).layout
    step = plan.decide(look(130.0, 10.0), up_only=True)
    assert step.reason is Reason.SCALE_UP, step
    # the step's own load, as the pools' floor prices it (its window plus the headroom)
    own = Observation(130.0, step.layout, Workload(high * 1.1, *CONV, span_s=10.0))
    assert plan.predict(own, step.layout).feasible, step
    # the averaged window alone would have kept fewer decode workers
    averaged = Planner(H100, SLO)
    for i in range(4):
        averaged.decide(look(30 * i + 30, 30.0))
    wide = look(130.0, 10.0)
    fewer = averaged.decide(replace(wide, load=replace(wide.load, span_s=30.0), t=150.0))
    assert fewer.layout.decode < step.layout.decode, (fewer, step)
    # the decode window of a look 40 s after the step began reads those 40 s at most
    asked: list[float] = []

    def over(s: float) -> Workload:
        asked.append(s)
        return Workload(high, *CONV, span_s=s)

    plan.memory.decode_window(10.0, 30.0, 1000.0, over, now=160.0)
    assert asked[0] == pytest.approx(40.0) and max(asked) <= 40.0


def test_a_tail_measured_within_trust_outranks_the_predicted_one() -> None:
    """A window that measured the serving layout's TTFT tail within ``trust`` of its target,
    on most of its arrivals, is a fact about that load: a prefill factor learned on other
    windows that prices it over the target grows nothing at a decision, and a check that must
    grow decode (its pool cannot keep up) does not add a prefill worker with it. Too small a
    share of the arrivals ended, a tail past the trusted share, a measured miss, or trust 0,
    and the prediction stands."""
    layout, rate = Layout(2, 2), 20.0
    arrivals = int(rate * 30)

    def window(t: float, ended: int, ttft_s: float = 0.2, attainment: float = 1.0) -> Observation:
        load = Workload(rate, *CONV, span_s=30.0)
        return Observation(t, layout, load, requests=ended, attainment=attainment, ttft_s=ttft_s, tpot_s=0.05)

    def planner(config: PlannerConfig = SLO) -> Planner:
        plan = Planner(H100, config)
        plan.correction = StepCorrection(prefill=4.0)  # learned on windows with a heavier prompt tail
        return plan

    held = planner().decide(window(30, ended=arrivals * 3 // 4))
    assert held.reason is Reason.HOLD and held.layout == layout, held
    assert held.predicted.ttft_s > SLO.ttft_s  # the model's tail, still over the target
    assert "measured within 1 of the targets" in held.detail  # the log says what overruled it
    trusting = planner(replace(SLO, trust=0.9)).decide(window(30, ended=arrivals))
    assert trusting.reason is Reason.HOLD, trusting
    for config, grows in (
        (SLO, window(30, ended=arrivals // 3)),  # a step's arrivals have mostly not ended
        (replace(SLO, trust=0.75), window(30, ended=arrivals)),  # within the target, past the share trusted
        (SLO, window(30, ended=arrivals, attainment=0.85)),  # a measured miss
        (replace(SLO, trust=0.0), window(30, ended=arrivals)),  # nothing measured is trusted
    ):
        d = planner(config).decide(grows)
        assert d.reason is Reason.SCALE_UP and d.layout.prefill > layout.prefill, (config.trust, grows, d)
    with pytest.raises(ValueError, match="trust"):
        replace(SLO, trust=1.5)

    # a check whose decode pool cannot keep up (a batch cap) grows decode alone
    capped = replace(SLO, max_seqs=64)
    check = Observation(
        10,
        Layout(4, 1),
        Workload(40.0, *CONV, span_s=10.0),
        requests=300,
        attainment=0.95,
        ttft_s=0.1,
        tpot_s=0.05,
    )
    for ended, prefill_grows in ((300, False), (100, True)):
        plan = Planner(H100, capped)
        plan.correction = StepCorrection(prefill=3.0)  # 4P keeps up, over the TTFT target
        now = plan.predict(check, check.layout)
        assert now.ttft_s > SLO.ttft_s and math.isfinite(now.ttft_s) and now.tpot_s == math.inf
        d = plan.decide(replace(check, requests=ended), up_only=True)
        assert d.reason is Reason.SCALE_UP and d.layout.decode > 1, d
        assert (d.layout.prefill > 4) is prefill_grows, (ended, d)


@given(st.integers(0, 50), st.integers(0, 50), st.integers(-5, 60))
def test_fewest_passing_is_the_least_that_passes(lo: int, span: int, k: int) -> None:
    """The bisection the keep-up floor and the day's hindsight bound share: on a monotone test
    it returns the least passing count in the range, and None when even the largest fails,
    asking each count at most once per halving."""
    hi = lo + span
    asked: list[int] = []

    def ok(n: int) -> bool:
        assert lo <= n <= hi
        asked.append(n)
        return n >= k

    got = fewest_passing(lo, hi, ok)
    assert got == (None if k > hi else max(lo, k))
    assert fewest_passing(lo, hi, lambda n: False) is None
    assert len(asked) <= 2 + max(1, span).bit_length()
