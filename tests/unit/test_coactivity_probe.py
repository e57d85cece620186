"""The co-activity probe's bookkeeping: which of a decoding request's gaps fall in another
request's prefill, which touch none, which are left out."""

from __future__ import annotations

from benchmarks.coactivity import split_gaps


def test_gaps_are_split_by_the_prefill_windows() -> None:
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    # 4-5 and 5-6 lie in the first window (6 is its edge); 3-4 and 8-9 straddle one: neither list
    times[-1] = 12.0
    inside, outside = split_gaps(times, [(3.5, 6.0), (8.5, 8.7)], skip=1)
    assert inside == [1.0, 1.0]
    assert outside == [1.0, 1.0, 1.0, 1.0, 3.0]  # 1-2, 2-3, 6-7, 7-8, 9-12 (0-1 skipped)
    assert split_gaps(times, [], skip=4) == ([], [1.0] * 5 + [3.0])
