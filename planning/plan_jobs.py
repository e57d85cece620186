"""Goodput searches run point by point on worker processes, idle ones measuring ahead.

``pdserve plan`` runs one goodput search (``pdserve.bench.sweep.search``) per candidate
layout. A search is sequential — the rate it asks for next depends on the last one's
attainment — so what a job is handed is one point (a candidate simulated at one rate), and a
search waits on at most one point at a time. A job with nothing else to do (no point asked
for: at the end of a plan, or while the next candidates wait on a result) measures ahead: the
rates a running search would ask for next, breadth first over the outcomes of the point it
waits on (a pass before a miss), up to ``AHEAD_DEPTH`` answers ahead. The simulator is
deterministic, so a point measured ahead is the answer the search gets when it asks. A point
asked for waits on a guess only while that guess may still be asked for: a job running one no
search can ask for any more is stopped and replaced. What a search reports (its bracket, its
points, in the order asked) is exactly what it would be without measuring ahead.

Contract: the caller ``start``\\ s a search while ``free()`` > 0 and collects finished ones
with ``wait`` (a finished search holds its slot until collected); each is returned once and
nothing of it is kept. A job that dies fails ``wait`` with the point it was measuring.
``close`` stops the jobs at once. With one job there are no processes: points are measured in
the caller's process, when asked.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.process
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pdserve.bench.sweep import Bracket, Search

K = TypeVar("K", bound=Hashable)
Point = dict[str, Any]  # one measured point: at least "rate" and "slo_attainment"
# (key, rate) -> the point; run in a job's process (a module-level function, or a partial of one)
Measure = Callable[[Any, float], Point]

AHEAD_DEPTH = 3  # answers a guess may look past the point a search waits on


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


def _serve(conn: multiprocessing.connection.Connection, measure: Measure) -> None:
    """A job's loop: measure each (key, rate) sent, answer (ok, point or error) until None."""
    while (task := conn.recv()) is not None:
        try:
            conn.send((True, measure(*task)))
        except Exception as e:  # handed to the caller, which raises it when the point is asked for
            conn.send((False, RuntimeError(f"measuring {task[0]!r} at {task[1]:g}: {e!r}")))


@dataclass
class _Job:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    task: tuple[Any, float] | None = None  # (key, rate) it measures now


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
        self._ctx = multiprocessing.get_context()
        self._jobs: list[_Job] = [self._spawn() for _ in range(self.jobs)] if self.jobs > 1 else []
        self._runs: dict[K, _Run[K]] = {}
        self._done: list[tuple[K, Bracket, list[Point]]] = []

    @property
    def running(self) -> list[K]:
        return list(self._runs)

    def free(self) -> int:
        """Searches that may start now: one per job, less those running or finished and not
        yet collected (so that the caller sees each result before it starts the next)."""
        return self.jobs - len(self._runs) - len(self._done)

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

    def wait(self, ahead: bool = True) -> list[tuple[K, Bracket, list[Point]]]:
        """Block until at least one search has finished (at once if none runs); the finished
        ones. ``ahead``: idle jobs measure ahead meanwhile (the caller has nothing to start)."""
        while not self._done and self._runs:
            self._dispatch(ahead)
            busy = [j for j in self._jobs if j.task is not None]
            ready = multiprocessing.connection.wait(
                [j.conn for j in busy] + [j.process.sentinel for j in busy]
            )
            for job in busy:
                if job.conn in ready or job.process.sentinel in ready:
                    self._received(job)
        out, self._done = self._done, []
        return out

    def close(self) -> None:
        """Stop the jobs now (points measured ahead for nobody are not waited for)."""
        for job in self._jobs:
            job.process.kill()
        for job in self._jobs:
            job.process.join()
            job.conn.close()
        self._jobs = []

    # -- internals -------------------------------------------------------------------------------
    def _spawn(self) -> _Job:
        mine, theirs = self._ctx.Pipe()
        process = self._ctx.Process(target=_serve, args=(theirs, self.measure), daemon=True)
        process.start()
        theirs.close()
        return _Job(process, mine)

    def _dispatch(self, ahead: bool) -> None:
        """Give every point asked for a job — an idle one, else one running a guess no search
        can ask for any more, stopped and replaced — then, with ``ahead``, idle jobs the most
        useful guesses."""
        wanted = [(r.key, r.asked) for r in self._runs.values()]  # in start order
        asked = set(wanted)
        flying = {j.task for j in self._jobs if j.task is not None}
        useful: set[tuple[Any, float]] | None = None
        for task in wanted:
            if task in flying:
                continue
            job = next((j for j in self._jobs if j.task is None), None)
            if job is None:  # runs <= jobs: some job runs a guess
                if useful is None:
                    useful = {(r.key, rate) for r in self._runs.values() for rate in self._tree(r)}
                spent = next((j for j in self._jobs if j.task not in asked and j.task not in useful), None)
                if spent is None:  # every guess may still be asked for: the point waits for one
                    continue
                job = self._replace(spent)
            self._send(job, task)
        if not ahead:
            return
        for idle in [j for j in self._jobs if j.task is None]:
            guess = next(self._guesses(), None)
            if guess is None:
                return
            self._send(idle, guess)

    def _send(self, job: _Job, task: tuple[Any, float]) -> None:
        job.task = task
        job.conn.send(task)

    def _replace(self, job: _Job) -> _Job:
        job.process.kill()
        job.process.join()
        job.conn.close()
        new = self._spawn()
        self._jobs[self._jobs.index(job)] = new
        return new

    def _received(self, job: _Job) -> None:
        assert job.task is not None
        key, rate = job.task
        try:
            ok, got = job.conn.recv()
        except (EOFError, OSError):  # the job died: its end of the pipe closed unanswered
            job.process.join(1.0)  # reaped, so that its exit code is known
            raise RuntimeError(
                f"a plan job died (exit code {job.process.exitcode}) measuring {key!r} at {rate:g}"
            ) from None
        job.task = None
        run = self._runs.get(key)
        if run is None:  # its search ended before it asked
            return
        if ok:
            run.known[rate] = got
        else:  # a guess's failure matters once it is asked for
            run.failed[rate] = got
        if run.asked == rate:
            self._advance(run)

    def _advance(self, run: _Run[K]) -> None:
        """Answer what ``run`` asks from what is known, until it asks for something that is not
        (a job measures it; with one job it is measured here) or it ends."""
        while True:
            if run.asked in run.failed:
                raise run.failed[run.asked]
            point = run.known.get(run.asked)
            if point is None:
                if self._jobs:
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

    def _guesses(self) -> Iterator[tuple[K, float]]:
        """Points no job measures that a running search may ask for: searches in start order,
        for each the rates it asks next, breadth first over the outcomes of what it waits on,
        a pass before a miss (passing points are the slow ones to wait for)."""
        flying = {j.task for j in self._jobs if j.task is not None}
        for run in list(self._runs.values()):
            for rate in self._tree(run):
                if rate not in run.known and rate not in run.failed and (run.key, rate) not in flying:
                    yield run.key, rate

    @staticmethod
    def _tree(run: _Run[K]) -> Iterator[float]:
        """The rates ``run`` may ask for after the one it waits on, breadth first over the
        outcomes still unknown (a pass before a miss), ``AHEAD_DEPTH`` deep."""
        frontier: list[tuple[list[tuple[float, float]], float]] = [([], run.asked)]
        for _ in range(AHEAD_DEPTH):
            deeper = []
            for hyp, rate in frontier:
                seen = run.known.get(rate)
                outcomes = [float(seen["slo_attainment"])] if seen is not None else [1.0, 0.0]
                for attainment in outcomes:
                    path = [*hyp, (rate, attainment)]
                    nxt = replay(run.make, [*run.path, *path])
                    if nxt is not None:
                        yield nxt
                        deeper.append((path, nxt))
            frontier = deeper
