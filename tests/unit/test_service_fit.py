"""The service fit recovers, from step logs alone, how much slower the serving workers' steps
are than the engine's profile, alone and while the other worker steps."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import pytest

from pdserve.model_runtime.engine.step_log import StepRecord
from pdserve.simulator.calibration import HostCalibration
from pdserve.simulator.service_fit import ServiceFit, apply_fit, fit_line, fit_service, host_speed
from pdserve.steptime.fitted import FittedProfile

ENGINE = FittedProfile("engine", 0.02, 7e-4, 2e-7, 0.011, 4e-6, 8e-4, 3e-4, 2e10, 24576, 20000, 4096)
PX, DX, PCO, DCO = 1.15, 1.10, 1.2, 1.3  # the truth the logs are written from


def logs(
    co_steps: int = 10, slower_prefill: float = 1.0, slower_decode: Callable[[int], float] = lambda k: 1.0
) -> dict[str, list[StepRecord]]:
    """A prefill worker and a decode worker: first each alone, then prefills while decoding
    (every prefill ``slower_prefill`` times and the ``k``-th decode step ``slower_decode(k)``
    times the truth: a slower host, or steps that scatter)."""
    p: list[StepRecord] = []
    d: list[StepRecord] = []

    def decode_step(s: float, dc: tuple[tuple[int, int], ...], x: float) -> float:
        dd = ENGINE.step_time(dc) * DX * x * slower_decode(len(d))
        d.append(StepRecord(s, s + dd, dc))
        return dd

    t = 0.0
    for i in range(8):  # alone: a prompt, then its decode steps with nothing else running
        chunks = ((128 + 16 * i, 0),)
        dur = ENGINE.step_time(chunks) * PX * slower_prefill
        p.append(StepRecord(t, t + dur, chunks))
        t += dur + 0.001
        for k in range(6):
            t += decode_step(t, ((1, 128 + k),), 1.0) + 0.0005
    for i in range(co_steps):  # a prefill with decode steps running under all of it
        chunks = ((256, 0),)
        dur = ENGINE.step_time(chunks) * PX * PCO * slower_prefill
        p.append(StepRecord(t, t + dur, chunks))
        s = t
        while s < t + dur:
            s += decode_step(s, ((1, 300 + i),), DCO)
        t = s + 0.05
    return {"prefill-0": p, "decode-0": d}


def test_factors_come_back_from_the_logs() -> None:
    fit = fit_service(logs(), ENGINE)
    assert fit.calibration.prefill_x == pytest.approx(PX) and fit.calibration.decode_x == pytest.approx(DX)
    assert fit.calibration.prefill_coactive_x == pytest.approx(PCO)
    # the last decode step of each window sticks out past the prefill: only those wholly or
    # mostly inside count, and they all carry the same slowdown
    assert fit.calibration.decode_coactive_x == pytest.approx(DCO)
    assert fit.prefill_steps == 8 and fit.decode_steps == 48 and fit.prefill_coactive_steps == 10


def test_too_few_coactive_steps_leave_coactivity_at_one() -> None:
    fit = fit_service(logs(co_steps=2), ENGINE)
    assert fit.calibration.prefill_coactive_x == 1.0 and fit.prefill_coactive_steps == 2


def test_no_isolated_steps_of_a_kind_is_an_error() -> None:
    only_decode = {"decode-0": [r for r in logs()["decode-0"]][:10]}
    with pytest.raises(ValueError, match="with prefill work"):
        fit_service(only_decode, ENGINE)


def test_applied_fit_scales_whole_steps_by_kind_and_sets_coactivity() -> None:
    cal = HostCalibration(prefill_x=1.2, decode_x=1.1, prefill_coactive_x=1.3, decode_coactive_x=1.05)
    fit = ServiceFit(cal, 10, 10, 10, 10)
    served = apply_fit(ENGINE, fit)
    prompt, decodes = [(200, 0)], [(1, 100), (1, 50)]
    assert served.step_time(prompt) == pytest.approx(ENGINE.step_time(prompt) * 1.2)
    assert served.step_time(decodes) == pytest.approx(ENGINE.step_time(decodes) * 1.1)
    assert served.decode_time(2, 152) == pytest.approx(ENGINE.decode_time(2, 152) * 1.1)
    # a mixed step was measured as a step with prefill work: the whole of it takes that factor
    assert served.step_time(prompt + decodes) == pytest.approx(ENGINE.step_time(prompt + decodes) * 1.2)
    # the worker's own per-step cost is added after, not scaled
    over = served.with_calibration(dataclasses.replace(served.calibration, step_overhead_s=0.004))
    assert over.step_time(decodes) == pytest.approx(served.step_time(decodes) + 0.004)
    assert (served.calibration.prefill_coactive_x, served.calibration.decode_coactive_x) == (1.3, 1.05)
    assert served.name == "engine+service"
    unit = apply_fit(ENGINE, ServiceFit(HostCalibration(), 5, 5, 0, 0))
    for chunks in (prompt, decodes, prompt + decodes):
        assert unit.step_time(chunks) == ENGINE.step_time(chunks)
    with pytest.raises(ValueError, match="service factors"):
        HostCalibration(decode_x=0.0)


def test_fit_line_tells_a_constant_from_a_factor() -> None:
    preds = [0.009 + 0.001 * i for i in range(40)]  # 9-48 ms: a span a constant shows in
    on_line = [(p, 0.008 + 1.1 * p) for p in preds]
    a, x = fit_line(on_line)
    assert a == pytest.approx(0.008, rel=1e-6) and x == pytest.approx(1.1, rel=1e-6)
    # a descheduled step or two barely move the bins' medians (least squares would be off by
    # far more: 0.5 s and 0.9 s steps among 20-60 ms ones)
    noisy = [*on_line[:-2], (preds[5], 0.5), (preds[30], 0.9)]
    a, x = fit_line(noisy)
    assert a == pytest.approx(0.008, abs=1e-3) and x == pytest.approx(1.1, rel=0.05)


def test_fit_line_falls_back_to_a_factor() -> None:
    narrow = [(0.010 + 0.0001 * i, 0.018 + 0.0001 * i) for i in range(40)]  # 10-14 ms only
    a, x = fit_line(narrow)
    assert a == 0.0 and x == statistics.median(m / p for p, m in narrow)
    below_zero = [(p, 1.3 * p - 0.005) for p in (0.02 + 0.005 * i for i in range(40))]
    a, x = fit_line(below_zero)
    assert a == 0.0 and 1.0 < x < 1.3  # the median ratio, not a line starting below zero


def test_a_batch_ladder_lets_the_fit_find_a_constant_per_step() -> None:
    """Decode steps of 1-8 requests, each 8 ms over the engine's (a core lost to the router):
    the fit puts it in the constant, so a batch of 8 is not charged 8 ms x a ratio."""
    steps, t = [], 0.0
    for b, n in ((1, 400), (2, 20), (4, 20), (8, 20)):  # mostly one at a time, as under light load
        for k in range(n):
            chunks = tuple((1, 300 + (4 * k) % 120) for _ in range(b))
            dur = 0.008 + ENGINE.step_time(chunks) * 1.05
            steps.append(StepRecord(t, t + dur, chunks))
            t += dur + 0.001
    prompts = [StepRecord(1e3 + i, 1e3 + i + ENGINE.step_time(((100 + 40 * i, 0),)), ((100 + 40 * i, 0),))
               for i in range(12)]  # fmt: skip
    fit = fit_service({"colocated-0": steps + prompts}, ENGINE)
    assert fit.calibration.decode_s == pytest.approx(
        0.008, rel=0.02
    ) and fit.calibration.decode_x == pytest.approx(1.05, rel=0.02)
    served = apply_fit(ENGINE, fit)
    big = ((1, 300),) * 8
    assert served.step_time(big) == pytest.approx(0.008 + 1.05 * ENGINE.step_time(big), rel=0.02)
    assert fit.calibration.prefill_s == pytest.approx(
        0.0, abs=1e-9
    ) and fit.calibration.prefill_x == pytest.approx(1.0)


def test_the_fit_measures_how_steps_scatter_around_it() -> None:
    clean = fit_service(logs(), ENGINE)
    inner = clean.calibration.decode_jitter[2:-2]  # the ends: decode steps sticking out of a prefill
    assert all(q == pytest.approx(1.0) for q in inner)
    # every other decode step 20 % slower, in runs of 5: a scatter of median 1 with a tail
    fit = fit_service(logs(slower_decode=lambda k: 1.2 if (k // 5) % 2 else 1.0), ENGINE)
    lo, hi = fit.calibration.decode_jitter[2], fit.calibration.decode_jitter[-3]
    assert lo < 1.0 < hi and 1.15 < hi / lo < 1.45  # the 20 %, give or take the fit's own share
    # slow steps came in runs: correlated, unlike the same steps alternating
    alternating = fit_service(logs(slower_decode=lambda k: 1.2 if k % 2 else 1.0), ENGINE)
    assert (
        fit.calibration.jitter_corr > 0.3 and alternating.calibration.jitter_corr == 0.0
    )  # anti-correlated: 0
    served = apply_fit(ENGINE, fit)
    assert served.calibration == fit.calibration


def test_host_speed_is_measured_against_the_calibrated_profile_and_applied_by_kind() -> None:
    calibrated = apply_fit(ENGINE, fit_service(logs(), ENGINE))
    assert host_speed(logs(), calibrated) == pytest.approx((1.0, 1.0))
    slower = logs(slower_prefill=1.15, slower_decode=lambda k: 1.05)
    prefill, decode = host_speed(slower, calibrated)
    assert prefill == pytest.approx(1.15) and decode == pytest.approx(1.05)
    fast = calibrated.with_calibration(calibrated.calibration.at_speed(prefill, decode))
    prompt, decodes = [(200, 0)], [(1, 100), (1, 50)]
    assert fast.step_time(prompt) == pytest.approx(calibrated.step_time(prompt) * 1.15)
    assert fast.step_time(decodes) == pytest.approx(calibrated.step_time(decodes) * 1.05)
    # too few steps of a kind in the window: that kind keeps the calibration's speed, and says so
    with pytest.warns(UserWarning, match="with prefill work"):
        assert host_speed({"decode-0": slower["decode-0"][:20]}, calibrated) == pytest.approx((1.0, 1.05))
