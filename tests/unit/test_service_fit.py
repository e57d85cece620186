"""The service fit recovers, from step logs alone, how much slower the serving workers' steps
are than the engine's profile, alone and while the other worker steps."""

from __future__ import annotations

import dataclasses

import pytest

from model_runtime.engine.step_log import StepRecord
from model_runtime.latency import FittedProfile
from simulator.service_fit import ServiceFit, apply_fit, fit_service

ENGINE = FittedProfile("engine", 0.02, 7e-4, 2e-7, 0.011, 4e-6, 8e-4, 3e-4, 2e10, 24576, 20000, 4096)
PX, DX, PCO, DCO = 1.15, 1.10, 1.2, 1.3  # the truth the logs are written from


def logs(co_steps: int = 10) -> dict[str, list[StepRecord]]:
    """A prefill worker and a decode worker: first each alone, then prefills while decoding."""
    p: list[StepRecord] = []
    d: list[StepRecord] = []
    t = 0.0
    for i in range(8):  # alone: a prompt, then its decode steps with nothing else running
        chunks = ((128 + 16 * i, 0),)
        dur = ENGINE.step_time(chunks) * PX
        p.append(StepRecord(t, t + dur, chunks))
        t += dur + 0.001
        for k in range(6):
            dc = ((1, 128 + k),)
            dd = ENGINE.step_time(dc) * DX
            d.append(StepRecord(t, t + dd, dc))
            t += dd + 0.0005
    for i in range(co_steps):  # a prefill with decode steps running under all of it
        chunks = ((256, 0),)
        dur = ENGINE.step_time(chunks) * PX * PCO
        p.append(StepRecord(t, t + dur, chunks))
        s = t
        while s < t + dur:
            dc = ((1, 300 + i),)
            dd = ENGINE.step_time(dc) * DX * DCO
            d.append(StepRecord(s, s + dd, dc))
            s += dd
        t = s + 0.05
    return {"prefill-0": p, "decode-0": d}


def test_factors_come_back_from_the_logs() -> None:
    fit = fit_service(logs(), ENGINE)
    assert fit.prefill_x == pytest.approx(PX) and fit.decode_x == pytest.approx(DX)
    assert fit.prefill_coactive_x == pytest.approx(PCO)
    # the last decode step of each window sticks out past the prefill: only those wholly or
    # mostly inside count, and they all carry the same slowdown
    assert fit.decode_coactive_x == pytest.approx(DCO)
    assert fit.prefill_steps == 8 and fit.decode_steps == 48 and fit.prefill_coactive_steps == 10


def test_too_few_coactive_steps_leave_coactivity_at_one() -> None:
    fit = fit_service(logs(co_steps=2), ENGINE)
    assert fit.prefill_coactive_x == 1.0 and fit.prefill_coactive_steps == 2


def test_no_isolated_steps_of_a_kind_is_an_error() -> None:
    only_decode = {"decode-0": [r for r in logs()["decode-0"]][:10]}
    with pytest.raises(ValueError, match="with prefill work"):
        fit_service(only_decode, ENGINE)


def test_applied_fit_scales_whole_steps_by_kind_and_sets_coactivity() -> None:
    fit = ServiceFit(1.2, 1.1, 1.3, 1.05, 10, 10, 10, 10)
    served = apply_fit(ENGINE, fit)
    prompt, decodes = [(200, 0)], [(1, 100), (1, 50)]
    assert served.step_time(prompt) == pytest.approx(ENGINE.step_time(prompt) * 1.2)
    assert served.step_time(decodes) == pytest.approx(ENGINE.step_time(decodes) * 1.1)
    assert served.decode_time(2, 152) == pytest.approx(ENGINE.decode_time(2, 152) * 1.1)
    # a mixed step was measured as a step with prefill work: the whole of it takes that factor
    assert served.step_time(prompt + decodes) == pytest.approx(ENGINE.step_time(prompt + decodes) * 1.2)
    # the worker's own per-step cost is added after, not scaled
    over = dataclasses.replace(served, step_overhead_s=0.004)
    assert over.step_time(decodes) == pytest.approx(served.step_time(decodes) + 0.004)
    assert (served.prefill_coactive_x, served.decode_coactive_x) == (1.3, 1.05)
    assert served.name == "engine+service"
    unit = apply_fit(ENGINE, ServiceFit(1, 1, 1, 1, 5, 5, 0, 0))
    assert dataclasses.replace(unit, name=ENGINE.name) == ENGINE
    with pytest.raises(ValueError, match="service factors"):
        dataclasses.replace(ENGINE, service_decode_x=0.0)
