"""Cutting a sweep server's step log into the sweep's points."""

from __future__ import annotations

from benchmarks.point_speed import point_windows, window
from pdserve.model_runtime.engine.step_log import StepRecord


def sweep(points: int, per_point: int) -> dict[str, list[StepRecord]]:
    """A prefill worker that began ``per_point`` prompts a point, 100 s apart, and a decode
    worker stepping after each prompt."""
    pre, dec = [], []
    for p in range(points):
        for k in range(per_point):
            t = 100.0 * p + k
            pre.append(StepRecord(t, t + 0.2, ((200, 0),)))
            dec.extend(StepRecord(t + 0.3 + 0.02 * j, t + 0.31 + 0.02 * j, ((1, 200 + j),)) for j in range(5))
    return {"prefill-0": pre, "decode-0": dec}


def test_points_that_recorded_their_window_keep_it() -> None:
    pts = [{"rate": 1.0, "mono": [5.0, 60.0]}, {"rate": 0.5, "mono": [100.0, 190.0]}]
    assert point_windows(pts, {}, 10) == [(5.0, 60.0), (100.0, 190.0)]


def test_older_points_are_cut_by_the_prompts_they_began() -> None:
    logs = sweep(3, 10)
    spans = point_windows([{"rate": r} for r in (1.0, 0.5, 0.75)], logs, 10)
    assert spans is not None and len(spans) == 3
    for p, span in enumerate(spans):
        got = window(logs, span)
        assert len(got["prefill-0"]) == 10 and len(got["decode-0"]) == 50
        assert all(100 * p - 1 <= r.start < 100 * p + 100 for rs in got.values() for r in rs)
    # a chunk that resumes a prompt (position > 0) or a decode token begins nothing
    logs["prefill-0"].append(StepRecord(400.0, 400.1, ((64, 200),)))
    assert point_windows([{"rate": r} for r in (1.0, 0.5, 0.75)], logs, 10) is not None
    # counts that do not add up: no windows rather than wrong ones
    assert point_windows([{"rate": 1.0}, {"rate": 0.5}], logs, 10) is None
