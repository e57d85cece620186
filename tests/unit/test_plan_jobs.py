"""Goodput searches on a pool of jobs that measure ahead: the answers are the sequential ones."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.bench.sweep import Bracket, run_search, search
from pdserve.planning.plan_jobs import SearchPool, replay


def attainment(key: tuple[float, float], rate: float) -> float:
    """A candidate whose goodput is ``key[0]``, with a miss at ``key[1]`` below it (the
    non-monotone attainment of a finite run near 90 %)."""
    goodput, hole = key
    return 0.5 if rate > goodput or rate == hole else 0.95


def measure(key: tuple[float, float], rate: float, delay: float = 0.0) -> dict[str, Any]:
    time.sleep(delay)
    return {"rate": rate, "slo_attainment": attainment(key, rate)}


def broken(key: Any, rate: float) -> dict[str, Any]:
    raise RuntimeError(f"simulation of {key} at {rate} failed")


def make(key: tuple[float, float], beat: float = 0.0, first: int = 0) -> Any:
    return search(1.0, 12, 5, first=first, beat=beat)


def sequential(key: tuple[float, float], beat: float, first: int) -> tuple[Bracket, list[float]]:
    asked: list[float] = []

    def f(rate: float) -> float:
        asked.append(rate)
        return attainment(key, rate)

    return run_search(make(key, beat, first), f), asked


keys = st.tuples(st.sampled_from([3.0, 5.0, 9.5, 40.0, 100.0]), st.sampled_from([0.0, 2.0, 6.0, 8.0]))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(keys, st.sampled_from([0.0, 4.0, 8.0]), st.integers(0, 4)), min_size=1, max_size=5,
                unique_by=lambda t: t[0]))  # fmt: skip
def test_two_jobs_measuring_ahead_give_the_sequential_answers(
    cases: list[tuple[tuple[float, float], float, int]],
) -> None:
    """Every search's bracket and points (in the order asked) equal one job's, whatever was
    measured ahead; each finished search is returned once and nothing is left running."""
    pool: SearchPool[tuple[float, float]] = SearchPool(2, measure)
    try:
        got: dict[tuple[float, float], tuple[Bracket, list[float]]] = {}
        todo = list(cases)
        while todo or pool.running:
            while todo and pool.free() > 0:
                key, beat, first = todo.pop()
                pool.start(key, functools.partial(make, key, beat, first))
            for key, found, points in pool.wait(ahead=not todo):
                assert key not in got
                got[key] = (found, [p["rate"] for p in points])
    finally:
        pool.close()
    for key, beat, first in cases:
        assert got[key] == sequential(key, beat, first)


def test_one_job_measures_only_what_is_asked() -> None:
    calls: list[float] = []

    def counted(key: tuple[float, float], rate: float) -> dict[str, Any]:
        calls.append(rate)
        return measure(key, rate)

    pool: SearchPool[tuple[float, float]] = SearchPool(1, counted)
    pool.start((9.5, 0.0), functools.partial(make, (9.5, 0.0)))
    [(_, found, points)] = pool.wait()
    assert (found, [p["rate"] for p in points]) == sequential((9.5, 0.0), 0.0, 0)
    assert calls == [p["rate"] for p in points] and pool.running == []
    pool.close()


def test_a_lone_search_is_measured_ahead() -> None:
    slow = functools.partial(measure, delay=0.2)
    pool: SearchPool[tuple[float, float]] = SearchPool(2, slow)
    try:
        pool.start((9.5, 0.0), functools.partial(make, (9.5, 0.0)))
        t0 = time.monotonic()
        [(_, found, points)] = pool.wait(ahead=True)
        lone = time.monotonic() - t0
    finally:
        pool.close()
    assert (found, [p["rate"] for p in points]) == sequential((9.5, 0.0), 0.0, 0)
    # one at a time each point asked would take 0.2 s; those guessed were ready or running
    assert lone < 0.2 * len(points) - 0.1


def by_key(key: tuple[float, float, float], rate: float) -> dict[str, Any]:
    """``measure`` taking ``key[2]`` seconds; a key with a negative delay kills its job."""
    if key[2] < 0:
        os._exit(3)
    return measure(key[:2], rate, key[2])


def make3(key: tuple[float, float, float]) -> Any:
    return search(1.0, 12, 5)


def slow_above_one(key: tuple[float, float, float], rate: float) -> dict[str, Any]:
    """``by_key``, but every rate above 1 takes 5 s."""
    return measure(key[:2], rate, 5.0 if rate > 1 else key[2])


def test_a_guess_no_search_can_ask_for_gives_way_and_close_does_not_wait() -> None:
    pool: SearchPool[tuple[float, float, float]] = SearchPool(2, slow_above_one)
    short = functools.partial(search, 1.0, 2, 0)  # rate 1, then rate 2 only if 1 passes
    try:
        missing = (0.5, 0.0, 0.3)  # misses at 1: its search ends there
        pool.start(missing, short)
        pool._dispatch(ahead=True)  # one job on its rate 1, the other guessing its rate 2 (5 s)
        assert [k for k, _, _ in pool.wait()] == [missing]  # the guess at 2 runs on, for nobody
        slow, fast = (40.0, 0.0, 5.0), (40.0, 0.0, 0.0)
        pool.start(slow, functools.partial(search, 1.0, 1, 0))
        pool.start(fast, functools.partial(search, 1.0, 1, 0))
        t0 = time.monotonic()
        [(key, _, _)] = pool.wait(ahead=False)  # the idle job takes one, the spent guess's the other
        assert key == fast and time.monotonic() - t0 < 2.0
    finally:
        t0 = time.monotonic()
        pool.close()  # the slow search's point runs for seconds yet
        assert time.monotonic() - t0 < 2.0


def test_one_job_hands_back_each_search_before_the_next_starts() -> None:
    pool: SearchPool[tuple[float, float]] = SearchPool(1, measure)
    pool.start((3.0, 0.0), functools.partial(make, (3.0, 0.0)))
    assert pool.free() == 0  # finished, not yet collected: the caller records it first
    assert [k for k, _, _ in pool.wait()] == [(3.0, 0.0)] and pool.free() == 1


def test_a_dead_job_fails_the_wait_with_its_point() -> None:
    pool: SearchPool[tuple[float, float, float]] = SearchPool(2, by_key)
    try:
        pool.start((9.5, 0.0, -1.0), functools.partial(make3, (9.5, 0.0, -1.0)))
        with pytest.raises(RuntimeError, match=r"a plan job died \(exit code 3\) measuring"):
            pool.wait()
    finally:
        pool.close()


def test_a_failed_point_is_raised_and_a_key_runs_once() -> None:
    pool: SearchPool[str] = SearchPool(2, broken)
    try:
        pool.start("a", functools.partial(search, 1.0, 4, 2))
        with pytest.raises(ValueError, match="already running"):
            pool.start("a", functools.partial(search, 1.0, 4, 2))
        with pytest.raises(RuntimeError, match=r"simulation of a at 1\.0 failed"):
            pool.wait()
    finally:
        pool.close()


def test_replay_follows_a_search_path_and_ends_where_it_ends() -> None:
    mk = functools.partial(search, 1.0, 3, 1)
    assert replay(mk, []) == 1.0
    assert replay(mk, [(1.0, 1.0)]) == 2.0
    assert replay(mk, [(1.0, 1.0), (2.0, 0.0)]) == 1.5
    assert replay(mk, [(1.0, 1.0), (2.0, 0.0), (1.5, 1.0)]) is None  # the bisection's one step: done
    assert replay(mk, [(3.0, 1.0)]) is None  # not this search's path
