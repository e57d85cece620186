"""``pdserve bench --sweep``: the goodput rate, found the way DistServe defines it.

Goodput is the highest request rate at which joint SLO attainment stays >= the target (90 %).
The sweep doubles the rate from ``--sweep-min-rate`` until attainment falls below the target,
then bisects that bracket; each point runs ``--num-prompts`` requests (>= 300 recommended) for
each of ``--sweep-seeds`` seeds and takes the mean attainment. Attainment is assumed to fall as
the rate grows (it does, up to noise; the plot shows the points measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.flags import add_sweep_steps, int_at_least, positive_finite, share

PointFn = Callable[[float, int], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Bracket:
    """Where a goodput search ended. ``goodput`` is the highest rate that met the target (0 if
    none did); ``failed_at`` the lowest that missed (None when no rate missed: goodput is then a
    lower bound); ``stopped`` when the ``stop`` predicate ended the bisection early."""

    goodput: float
    failed_at: float | None
    stopped: bool = False

    @property
    def bracketed(self) -> bool:
        return self.failed_at is not None


Search = Generator[float, float, Bracket]


def search(
    start: float,
    doublings: int,
    steps: int,
    target: float = 0.9,
    stop: Callable[[float, float], bool] | None = None,
    first: int = 0,
    beat: float = 0.0,
) -> Search:
    """DistServe's goodput search as a generator: it yields the next rate to measure and is sent
    that rate's attainment. The rate doubles from ``start`` (at most ``doublings`` times) until
    attainment falls below ``target``, then ``steps`` bisections narrow the bracket;
    ``stop(failing rate, next rate)`` may end them early (e.g. the candidate cannot win any more).
    Drive it with ``run_search`` or, for async measurements, as ``sweep`` does.

    ``first``: the rate grid ``start · 2^k`` is entered at ``k = first`` rather than 0 (a warm
    start, e.g. near a similar candidate's goodput): from there it climbs while the target is
    met and otherwise descends until it is, so with attainment falling as the rate grows the
    bracket, and every rate bisected after it, are the ones a search from ``k = 0`` finds —
    without measuring the low rates (the slowest to simulate) on the way.

    ``beat``: a goodput the caller only cares to know about if this one reaches it (the best
    rival so far). It is measured first: a miss ends the search at once (``stopped``,
    ``failed_at = beat``, goodput 0: unknown, below ``beat``); after a pass the search runs as
    it would without ``beat`` (that rate is not measured twice). Rates at or below a passing
    ``beat`` are measured, not assumed met: a finite run's attainment is not always monotone
    in the rate (near 90 % one rate may miss where a higher one passes), and the answer must
    be the one the search without ``beat`` gives. With attainment falling as the rate grows,
    a miss at ``beat`` means that search ends below it."""
    if doublings <= 0:
        return Bracket(0.0, None)
    seen: dict[float, bool] = {}

    def met(rate: float) -> Generator[float, float, bool]:
        if rate not in seen:
            seen[rate] = (yield rate) >= target
        return seen[rate]

    if beat > 0 and not (yield from met(beat)):
        return Bracket(0.0, beat, stopped=True)

    grid = [start * 2**k for k in range(doublings)]
    entry = max(0, min(first, doublings - 1))
    lo, hi = 0.0, grid[entry]
    if (yield from met(hi)):
        lo = hi
        for rate in grid[entry + 1 :]:
            if not (yield from met(rate)):
                hi = rate
                break
            lo = rate
        else:
            return Bracket(lo, None)
    else:
        for rate in reversed(grid[:entry]):
            if (yield from met(rate)):
                lo = rate
                break
            hi = rate
    for _ in range(steps):
        mid = (lo + hi) / 2 if lo else hi / 2
        if stop is not None and mid not in seen and stop(hi, mid):  # a known rate costs nothing
            return Bracket(lo, hi, stopped=True)
        if (yield from met(mid)):
            lo = mid
        else:
            hi = mid
    return Bracket(lo, hi)


def run_search(s: Search, measure: Callable[[float], float]) -> Bracket:
    """Drive ``search`` with a synchronous ``measure(rate) -> attainment``."""
    try:
        rate = next(s)
        while True:
            rate = s.send(measure(rate))
    except StopIteration as done:
        result: Bracket = done.value
        return result


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sweep", action="store_true", help="bisect the rate for the goodput point (needs --goodput)"
    )
    p.add_argument("--sweep-min-rate", type=positive_finite, default=0.5)
    p.add_argument("--sweep-max-doublings", type=int_at_least(0), default=10)
    add_sweep_steps(p)
    p.add_argument("--sweep-seeds", type=int_at_least(1), default=2)
    p.add_argument("--sweep-target", type=share, default=0.9, help="attainment that defines goodput")
    p.add_argument("--sweep-plot", type=Path, default=None, help="PNG path (default: next to the result)")


async def sweep(point: PointFn, args: argparse.Namespace) -> dict[str, Any]:
    """``point(rate, seed)`` runs one load point and returns its metrics (``summarize``'s dict)."""
    target = args.sweep_target
    points: list[dict[str, Any]] = []

    async def measure(rate: float) -> float:
        # A fresh seed for every run of the sweep: the same prompts replayed against the same
        # server would hit the prefix cache their earlier run filled and look cheaper than they are.
        first = args.seed + len(points) * args.sweep_seeds
        runs = [await point(rate, first + s) for s in range(args.sweep_seeds)]
        att = statistics.fmean(r["slo_attainment"] for r in runs)
        row: dict[str, Any] = {"rate": rate, "slo_attainment": att}
        for key in ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms",
                    "p99_tpot_ms", "request_goodput", "request_throughput"):  # fmt: skip
            row[key] = statistics.fmean(r[key] for r in runs)
        points.append(row)
        print(f"  rate {rate:8.3f} req/s: attainment {att:.3f}", file=sys.stderr, flush=True)
        return att

    s = search(args.sweep_min_rate, args.sweep_max_doublings, args.sweep_steps, target)
    try:
        rate = next(s)
        while True:
            rate = s.send(await measure(rate))
    except StopIteration as done:
        found: Bracket = done.value
    return {
        "goodput_rate": found.goodput,
        "bracketed": found.bracketed,
        "target": target,
        "points": sorted(points, key=lambda r: r["rate"]),
    }


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted(result["points"], key=lambda r: r["rate"])
    rates = [p["rate"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(rates, [p["slo_attainment"] for p in pts], "o-")
    a.axhline(result["target"], color="gray", linestyle="--")
    a.axvline(
        result["goodput_rate"],
        color="green",
        linestyle=":",
        label=f"goodput {result['goodput_rate']:.2f} req/s",
    )
    a.set(xlabel="request rate (req/s)", ylabel="joint SLO attainment", ylim=(0, 1.05), title=title)
    a.legend()
    for key, style in (
        ("median_ttft_ms", "o-"),
        ("p99_ttft_ms", "o--"),
        ("median_tpot_ms", "s-"),
        ("p99_tpot_ms", "s--"),
    ):
        b.plot(rates, [p[key] for p in pts], style, label=key.replace("_ms", ""))
    b.set(xlabel="request rate (req/s)", ylabel="ms", yscale="log", title="latency percentiles")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save(result: dict[str, Any], args: argparse.Namespace) -> Path:
    name = args.result_filename or f"sweep-{args.backend}.json"
    path: Path = args.result_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return path
