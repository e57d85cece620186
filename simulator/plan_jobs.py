"""Goodput searches run point by point on a pool of processes, idle jobs measuring ahead.

``pdserve plan`` runs one goodput search (``pdserve.bench.sweep.search``) per candidate
layout. A search is sequential — the rate it asks for next depends on the last one's
attainment — so what a job is handed is one point (a candidate simulated at one rate), and a
search waits on at most one point at a time. A job with nothing else to do (no search to
start: at the end of a plan, or while the next candidates wait on a result) measures ahead:
the rate a running search would ask for next if the point it waits on passes, then if it
fails, then one answer deeper. The simulator is deterministic, so a point measured ahead is
the answer the search gets when it asks; a wrong guess costs a job that would have idled.
What a search reports (its bracket, its points, in the order asked) is exactly what it would
be without measuring ahead.

Contract: the caller ``start``\\ s a search while ``free()`` > 0 and collects finished ones
with ``wait``; each finished search is returned once, and nothing of it is kept (its points
measured ahead are dropped). ``close`` stops the jobs, measuring ahead or not; with one job
points are measured in the caller's process, when asked.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pdserve.bench.sweep import Bracket, Search

K = TypeVar("K", bound=Hashable)
Point = dict[str, Any]  # one measured point: at least "rate" and "slo_attainment"
# (key, rate) -> the point; run in a job's process, so a module-level function (or a partial)
Measure = Callable[[Any, float], Point]
Finished = tuple[Any, Bracket, list[Point]]  # (key, where its search ended, its points in order)

AHEAD_DEPTH = 3  # answers a guess looks past the point a search waits on


def replay(make: Callable[[], Search], answers: list[tuple[float, float]]) -> float | None:
    """The rate a fresh search from ``make`` asks after ``answers`` ((rate, attainment), in the
    order asked); None when it ends there (or asks other rates: not this search's path)."""
    gen = make()
    try:
        rate = next(gen)
        for asked, attainment in answers:
            if asked != rate:
                return None
            rate = gen.send(attainment)
    except StopIteration:
        return None
    finally:
        gen.close()
    return rate


@dataclass
class _Run(Generic[K]):
    key: K
    make: Callable[[], Search]
    gen: Search
    asked: float  # the rate it waits on
    path: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment) answered
    points: list[Point] = field(default_factory=list)
    known: dict[float, Point] = field(default_factory=dict)  # measured, ahead of time included
    failed: dict[float, BaseException] = field(default_factory=dict)  # raised when asked for


class SearchPool(Generic[K]):
    def __init__(
        self, jobs: int, measure: Measure, on_point: Callable[[K, Point], None] | None = None
    ) -> None:
        self.jobs = max(1, jobs)
        self.measure = measure
        self.on_point = on_point
        self._pool = multiprocessing.Pool(self.jobs) if self.jobs > 1 else None
        self._results: queue.Queue[tuple[K, float, Point | BaseException]] = queue.Queue()
        self._runs: dict[K, _Run[K]] = {}
        self._flying: set[tuple[K, float]] = set()
        self._done: list[Finished] = []

    @property
    def running(self) -> list[K]:
        return list(self._runs)

    def free(self) -> int:
        """Searches that could start now: one per job, less those running (points measured
        ahead borrow idle jobs and do not count)."""
        return self.jobs - len(self._runs)

    def start(self, key: K, make: Callable[[], Search]) -> None:
        """Begin ``make()``'s search for ``key`` (a fresh generator each call: guesses replay it)."""
        if key in self._runs:
            raise ValueError(f"a search for {key!r} is already running")
        gen = make()
        try:
            rate = next(gen)
        except StopIteration as stop:
            self._done.append((key, stop.value, []))
            return
        run = _Run(key, make, gen, rate)
        self._runs[key] = run
        self._advance(run)

    def wait(self, ahead: bool = True) -> list[Finished]:
        """Block until at least one search has finished (at once if none runs); the finished
        ones. ``ahead``: idle jobs measure ahead meanwhile (the caller has nothing to start)."""
        while not self._done and self._flying:
            if ahead:
                self._measure_ahead()
            key, rate, got = self._results.get()
            self._flying.discard((key, rate))
            run = self._runs.get(key)
            if run is None:  # its search ended before it asked
                continue
            if isinstance(got, BaseException):  # a guess's failure matters once it is asked for
                run.failed[rate] = got
            else:
                run.known[rate] = got
            if run.asked == rate:
                self._advance(run)
        out, self._done = self._done, []
        return out

    def close(self) -> None:
        """Stop the jobs now (points measured ahead for nobody are not waited for)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _advance(self, run: _Run[K]) -> None:
        """Answer what ``run`` asks from what is known, until it asks for something that is not
        (then it is measured: in a job, or here with one job) or it ends."""
        while True:
            if run.asked in run.failed:
                raise run.failed[run.asked]
            point = run.known.get(run.asked)
            if point is None:
                if self._pool is not None:
                    if (run.key, run.asked) not in self._flying:
                        self._submit(run.key, run.asked)
                    return
                point = run.known[run.asked] = self.measure(run.key, run.asked)
            attainment = float(point["slo_attainment"])
            run.points.append(point)
            run.path.append((run.asked, attainment))
            if self.on_point is not None:
                self.on_point(run.key, point)
            try:
                run.asked = run.gen.send(attainment)
            except StopIteration as stop:
                del self._runs[run.key]
                self._done.append((run.key, stop.value, run.points))
                return

    def _submit(self, key: K, rate: float) -> None:
        assert self._pool is not None
        self._flying.add((key, rate))
        results = self._results
        self._pool.apply_async(
            self.measure,
            (key, rate),
            callback=lambda p: results.put((key, rate, p)),
            error_callback=lambda e: results.put((key, rate, e)),
        )

    def _measure_ahead(self) -> None:
        while len(self._flying) < self.jobs:
            guess = next(self._guesses(), None)
            if guess is None:
                return
            self._submit(*guess)

    def _guesses(self) -> Iterator[tuple[K, float]]:
        """Points no job measures that a running search may ask for: searches in start order,
        for each the rates it asks next, breadth first over the outcomes of what it waits on,
        a pass before a miss (passing points are the slow ones to wait for)."""
        for run in list(self._runs.values()):
            frontier: list[tuple[list[tuple[float, float]], float]] = [([], run.asked)]
            for _ in range(AHEAD_DEPTH):
                deeper = []
                for hyp, rate in frontier:
                    seen = run.known.get(rate)
                    outcomes = [float(seen["slo_attainment"])] if seen is not None else [1.0, 0.0]
                    for attainment in outcomes:
                        path = [*hyp, (rate, attainment)]
                        nxt = replay(run.make, [*run.path, *path])
                        if nxt is None:
                            continue
                        if (
                            nxt not in run.known
                            and nxt not in run.failed
                            and (run.key, nxt) not in self._flying
                        ):
                            yield run.key, nxt
                        deeper.append((path, nxt))
                frontier = deeper
