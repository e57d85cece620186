"""The live autoscale benchmark's windows: the step to target by end and by arrival."""

from __future__ import annotations

from benchmarks.autoscale import step_to_target
from benchmarks.autoscale_live import by_window, misses_by_window, to_target
from pdserve.bench.metrics import RequestResult, Slo


def test_windows_hold_each_time_in_its_own_interval() -> None:
    met = [True, False, True, True]
    assert by_window(met, [0.0, 29.9, 30.0, 95.0], 30.0) == [(30.0, 0.5, 2), (60.0, 1.0, 1), (120.0, 1.0, 1)]


def test_step_to_target_counts_from_the_step_to_the_first_window_back() -> None:
    windows = [(30.0, 1.0), (60.0, 0.5), (90.0, 0.8), (120.0, 0.95), (150.0, 0.5)]
    assert step_to_target(windows, 30.0) == 90.0
    assert step_to_target([(30.0, 1.0), (60.0, 0.95)], 30.0) == 0.0  # nothing missed after the step
    assert step_to_target([(30.0, 1.0), (60.0, 0.5)], 30.0) is None  # never back


def test_a_backlog_draining_late_misses_by_end_but_not_by_arrival() -> None:
    """The step's own requests (arrived 30-60 s, missed) end two windows later; what arrived
    after them met: by arrival the target is back 60 s after the step, by end 120 s."""
    arrivals = [10.0, 20.0, 35.0, 45.0, 65.0, 75.0, 95.0, 105.0, 115.0]
    ends = [15.0, 25.0, 100.0, 110.0, 70.0, 80.0, 99.0, 108.0, 125.0]
    met = [True, True, False, False, True, True, True, True, True]
    run = {"windows": by_window(met, ends, 30.0), "arrival_windows": by_window(met, arrivals, 30.0)}
    assert to_target(run, 30.0) == {"by_end": 120.0, "by_arrival": 60.0}


def test_misses_are_told_apart_by_the_target_they_broke() -> None:
    slo = Slo(ttft_ms=1000.0, tpot_ms=100.0)

    def done(ttft: float, tpot: float) -> RequestResult:  # 11 tokens: ten gaps of ``tpot``
        return RequestResult(10, True, 11, ttft, [tpot] * 10, ttft + 10 * tpot)

    results = [
        done(0.5, 0.05),  # met
        done(1.5, 0.05),  # TTFT only
        done(0.5, 0.2),  # TPOT only
        done(2.0, 0.3),  # both
        RequestResult(10, error="refused"),  # failed: neither tail counts it
        done(0.2, 0.05),  # the next window
    ]
    rows = misses_by_window(slo, results, [1.0, 2.0, 3.0, 4.0, 5.0, 40.0], 30.0)
    assert rows[0][:5] == (30.0, 5, 1, 2, 2)
    assert rows[0][5] == 2000.0  # the 90th percentile of the four served: the slowest
    assert rows[1] == (60.0, 1, 0, 0, 0, 200.0)
