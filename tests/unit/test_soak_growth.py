"""The soak's growth figures: the median of the last minute less the median of minute 2, for
the deployment and for each worker present in both (a replaced worker has no growth of its own)."""

from __future__ import annotations

from benchmarks.soak import Sample, growth, worker_growth


def sample(t: float, workers: dict[str, tuple[float, float]]) -> Sample:
    rss = sum(r for r, _ in workers.values())
    each = tuple((wid, r, a) for wid, (r, a) in workers.items())
    return Sample(t, rss, sum(a for _, a in workers.values()), 0, 0, 0, 0, 0.0, 0, 0, each)


def test_growth_is_last_minute_median_less_minute_two_median() -> None:
    # a spike in either window does not move a median of three
    samples = [sample(t, {"d0": (100.0 + (500 if t == 70 else 0), 50.0)}) for t in (0, 60, 70, 80)]
    samples += [sample(t, {"d0": (130.0 + (900 if t == 290 else 0), 60.0)}) for t in (250, 270, 290)]
    assert growth(samples, "rss_mib", 300.0) == 30.0
    assert worker_growth(samples, 300.0) == {"d0": 30.0}
    assert worker_growth(samples, 300.0, anon=True) == {"d0": 10.0}


def test_a_worker_missing_from_either_window_has_no_growth() -> None:
    early = [sample(t, {"d0": (100.0, 10.0), "p0": (200.0, 20.0)}) for t in (60, 90)]
    late = [sample(t, {"d0": (104.0, 10.0), "p1": (900.0, 90.0)}) for t in (250, 280)]
    assert worker_growth(early + late, 300.0) == {"d0": 4.0}  # p0 was replaced by p1
    assert worker_growth(early, 300.0) == {}  # nothing in the last minute: no figure
    assert growth(early, "rss_mib", 300.0) == 0.0
