"""The day bound's arithmetic (``benchmarks/day_bound.py``): the runs themselves are the
benchmark's."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.day_bound import hour_sums, hourly_rates, parse_layout


def test_a_layout_is_parsed_or_refused() -> None:
    assert parse_layout("28P+19D") == (28, 19)
    assert parse_layout("1p+1d") == (1, 1)
    for bad in ("28P19D", "0P+1D", "P+D", "-1P+2D", "3P+2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_layout(bad)


def test_the_hourly_points_follow_the_cosine_day() -> None:
    rates = hourly_rates(250.0, 4.0)
    assert len(rates) == 24
    assert rates[4] == pytest.approx(250.0) and rates[16] == pytest.approx(1000.0)
    assert rates[3] == pytest.approx(rates[5]) and rates[15] == pytest.approx(rates[17])


@given(st.lists(st.integers(1, 64), min_size=1, max_size=48))
def test_the_sums_bracket_the_points(workers: list[int]) -> None:
    s = hour_sums(workers)
    assert s["bound_lower"] <= s["bound_points"] <= s["bound_upper"]
    assert s["bound_lower"] + s["bound_upper"] == 2 * s["bound_points"]  # each point is two ends
    if len(set(workers)) == 1:
        assert s["bound_lower"] == s["bound_upper"]


def test_the_hours_wrap_around_midnight() -> None:
    assert hour_sums([1, 5]) == {"bound_lower": 2, "bound_points": 6, "bound_upper": 10}
