"""The planner's correction of the step times: a decode fit that tells a fixed cost a step from a
factor on it, and what that changes at a peak."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.planning.capacity import decode_step_at, predict
from pdserve.planning.planner import Planner
from pdserve.planning.planner_data import Bounds, Layout, Observation, PlannerConfig
from pdserve.planning.step_correction import MOST, NONE, DecodePoint, StepCorrection, fit_decode
from pdserve.router.workload_window import Workload
from pdserve.steptime.roofline import H100_LLAMA3_8B as H100

CONV = (1263.0, 209.0)
SLO = PlannerConfig(ttft_s=0.25, tpot_s=0.1, bounds=Bounds(1, 8, 1, 8))


@settings(max_examples=200, deadline=None)
@given(
    factor=st.floats(1.0, 3.0),
    fixed_steps=st.floats(0.0, 2.0),
    models=st.lists(st.floats(0.005, 0.05), min_size=2, max_size=10).filter(lambda m: max(m) > 1.5 * min(m)),
)
def test_windows_at_two_batch_sizes_recover_the_factor_and_the_fixed_cost(
    factor: float, fixed_steps: float, models: list[float]
) -> None:
    fixed = fixed_steps * sum(models) / len(models)
    f, c = fit_decode([DecodePoint(m, factor * m + fixed) for m in models])
    for m in models:  # each step priced as measured, whatever the split
        assert f * m + c == pytest.approx(factor * m + fixed, rel=0.02)
    # the ridge's pull toward an even split moves the factor by up to about 10 % where the
    # batch sizes span only 1.5x and the fixed cost is twice a step (a searched worst case)
    assert f == pytest.approx(factor, rel=0.1, abs=0.1)


def test_one_batch_size_splits_the_excess_evenly_and_prices_it_as_measured() -> None:
    f, c = fit_decode([DecodePoint(0.010, 0.016)] * 3)
    assert f * 0.010 + c == pytest.approx(0.016, rel=0.01)
    assert (f - 1) * 0.010 == pytest.approx(c, rel=0.01)


@pytest.mark.parametrize(
    ("points", "bounds"),
    [
        ([], (1.0, 0.0)),
        ([DecodePoint(0.01, 0.005)], (1.0, 0.0)),  # faster than the model: never below it
        ([DecodePoint(0.01, 1e-40), DecodePoint(0.01, math.nan), DecodePoint(0.01, math.inf)], (1.0, 0.0)),
        ([DecodePoint(0.0, 0.01), DecodePoint(-1.0, 0.01)], (1.0, 0.0)),
    ],
)
def test_what_the_fit_cannot_learn_from_leaves_the_model(
    points: list[DecodePoint], bounds: tuple[float, float]
) -> None:
    assert fit_decode(points) == bounds


def test_the_fit_is_bounded() -> None:
    f, c = fit_decode([DecodePoint(0.01, 0.9), DecodePoint(0.02, 0.95)])  # 45-90x: past the bounds
    assert 1.0 <= f <= MOST and 0.0 <= c <= MOST * 0.015
    f, c = fit_decode([DecodePoint(0.01, 0.011), DecodePoint(0.02, 0.8)])  # no line through both
    assert 1.0 <= f <= MOST and 0.0 <= c <= MOST * 0.015


def test_decode_step_at_reads_the_batch_by_littles_law_and_refuses_a_slot_queue() -> None:
    load = Workload(20.0, *CONV)
    truth = predict(H100, load, 8, 1, 0.9)
    step = decode_step_at(H100, load, 1, truth.tpot_s)
    assert step == pytest.approx(truth.tpot_s, rel=1e-6)  # the model's own fixed point
    assert decode_step_at(H100, load, 1, truth.tpot_s, max_seqs=8) is None  # 39 requests, 8 slots
    assert decode_step_at(H100, load, 1, math.nan) is None
    assert decode_step_at(H100, Workload(0.0, *CONV), 1, 0.01) is None


def _served(plan: Planner, t: float, rate: float, layout: Layout, fixed_s: float) -> None:
    """A decision on a window served by workers whose decode steps cost ``fixed_s`` more than
    the model's."""
    window = Observation(t, layout, Workload(rate, *CONV))
    truth = predict(H100, window.load, layout.prefill, layout.decode, 0.9, decode_fixed_s=fixed_s)
    plan.decide(Observation(t, layout, window.load, 150, 1.0, truth.ttft_s, truth.tpot_s))


def test_a_fixed_cost_a_step_is_not_priced_as_a_slower_worker_at_the_peak() -> None:
    """Workers whose decode steps cost 6 ms more than the model's: measured at 3 req/s alone the
    excess is split between factor and fixed cost; measured at 20 req/s too, it is the fixed
    cost, and one decode worker is priced at 35 req/s as it serves them (a factor of 1.9 learned
    at 3 req/s prices it past saturation)."""
    layout, fixed = Layout(8, 1), 0.006
    plan = Planner(H100, SLO)
    for i in range(3):
        _served(plan, 30.0 * i, 3.0, layout, fixed)
    one = plan.correction
    assert one.decode > 1.0 and one.decode_fixed_s > 0.0
    for i in range(3, 7):
        _served(plan, 30.0 * i, 20.0, layout, fixed)
    assert plan.correction.decode == pytest.approx(1.0, abs=0.03)
    assert plan.correction.decode_fixed_s == pytest.approx(fixed, rel=0.05)
    assert plan.correction.prefill == pytest.approx(1.0, abs=0.01)
    peak = Observation(300.0, layout, Workload(35.0, *CONV))
    truth = predict(H100, peak.load, 8, 1, 0.9, decode_fixed_s=fixed)
    assert plan.predict(peak, layout).tpot_s == pytest.approx(truth.tpot_s, rel=0.05)
    trough = predict(H100, Workload(3.0, *CONV), 8, 1, 0.9, decode_fixed_s=fixed)
    as_factor = StepCorrection(decode=trough.tpot_s / predict(H100, Workload(3.0, *CONV), 8, 1).tpot_s)
    assert as_factor.decode > 1.8
    assert not math.isfinite(plan._price(peak, layout, 1.0, correction=as_factor).tpot_s)


def test_a_model_that_is_right_learns_nothing() -> None:
    plan = Planner(H100, SLO)
    for i, rate in enumerate((3.0, 3.0, 20.0, 20.0, 35.0)):
        _served(plan, 30.0 * i, rate, Layout(8, 1), 0.0)
    assert plan.correction.decode == pytest.approx(1.0, abs=0.01)
    assert plan.correction.decode_fixed_s == pytest.approx(0.0, abs=2e-4)
    assert str(NONE) == "prefill x1.00, decode x1.00 + 0.0 ms"
