"""Step-time variability: how a worker's real steps scatter around the latency model (pure).

A latency model gives a step's typical time. Real steps vary around it — the OS deschedules a
thread, a neighbour on the host takes memory bandwidth, a GPU's clocks move — and they vary in
runs: a slow step is usually followed by another, because what slowed it lasts longer than a
step. A simulator without this predicts medians well and tails badly, and SLO attainment is
decided in the tails (a request misses TTFT when its prefill lands on a slow stretch).

The model here is a Gaussian copula: each worker carries a latent standard-normal state that
moves from step to step as an AR(1) process with lag-1 correlation ``rho``; a step's factor is
the measured ratio distribution (measured over modelled, median 1) at the probability
``Phi(state)``. The marginal distribution is the measured one exactly, whatever ``rho``; ``rho``
only says how long slow stretches last. Steps with prefill work and decode-only steps read
their own distributions off the same latent state (what slows one slows the other).

``fit_jitter`` measures both from a worker's sequence of ratios; ``StepJitter`` draws them.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Iterable, Sequence

# quantiles at probabilities 0, 1/100, ..., 1: the sampler interpolates linearly between them,
# so the last bin spreads 1 % of draws up to the worst step logged (with 20 bins, 5 % of draws
# did, and the simulated 99th percentile came out far above the measured one)
GRID = 101
_NORMAL = statistics.NormalDist()


def quantile_grid_checked(name: str, grid: Iterable[float]) -> tuple[float, ...]:
    """``grid`` as a tuple, if it is a quantile grid: empty, or at least two positive,
    non-decreasing values."""
    g = tuple(float(q) for q in grid)
    if g and (len(g) < 2 or g[0] <= 0 or any(b < a for a, b in itertools.pairwise(g))):
        raise ValueError(f"{name} must be >= 2 positive, non-decreasing quantiles")
    return g


def quantile_grid(ratios: Sequence[float], points: int = GRID) -> tuple[float, ...]:
    """``points`` quantiles of ``ratios`` at equally spaced probabilities from 0 to 1 (the first
    is the minimum, the last the maximum), divided by their median: the shape of the scatter,
    with the typical step left to the model."""
    if len(ratios) < 2 or points < 2:
        raise ValueError("a quantile grid needs at least two ratios and two points")
    if any(r <= 0 for r in ratios):
        raise ValueError("step-time ratios must be > 0")
    s = sorted(ratios)
    med = statistics.median(s)
    return tuple(_at(s, k / (points - 1)) / med for k in range(points))


def _at(values: Sequence[float], p: float) -> float:
    """Linear interpolation in sorted ``values`` (at least two) at probability ``p`` in [0, 1]."""
    pos = p * (len(values) - 1)
    i = min(len(values) - 2, int(pos))
    return values[i] + (values[i + 1] - values[i]) * (pos - i)


def normal_scores(values: Sequence[float]) -> list[float]:
    """Each value's rank turned into a standard-normal score (``Phi^-1((rank + 1/2) / n)``,
    equal values sharing their mean rank): the latent state a copula model gives that
    sequence."""
    n = len(values)
    order = sorted(range(n), key=values.__getitem__)
    z = [0.0] * n
    start = 0
    while start < n:
        end = start
        while end + 1 < n and values[order[end + 1]] == values[order[start]]:
            end += 1
        score = _NORMAL.inv_cdf(((start + end) / 2 + 0.5) / n)
        for k in range(start, end + 1):
            z[order[k]] = score
        start = end + 1
    return z


def lag1_correlation(z: Sequence[float]) -> float:
    """Lag-1 autocorrelation of a sequence (0 for fewer than three values or no variance)."""
    if len(z) < 3:
        return 0.0
    mu = statistics.fmean(z)
    var = sum((x - mu) ** 2 for x in z)
    if var <= 0:
        return 0.0
    return sum((a - mu) * (b - mu) for a, b in itertools.pairwise(z)) / var


def fit_jitter(
    sequences: Sequence[Sequence[tuple[bool, float]]], points: int = GRID, min_steps: int = 20
) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """``(prefill grid, decode grid, rho)`` from each worker's steps in order, each step as
    ``(has prefill work, measured / modelled)``.

    A kind with fewer than ``min_steps`` steps gets no grid (its steps stay deterministic).
    ``rho`` is the lag-1 correlation of the workers' normal scores (each kind scored within its
    own distribution, then put back in step order), weighted by length, clamped to [0, 0.99]."""
    by_kind: dict[bool, list[float]] = {True: [], False: []}
    for seq in sequences:
        for kind, ratio in seq:
            by_kind[kind].append(ratio)
    grids = {k: quantile_grid(v, points) if len(v) >= min_steps else () for k, v in by_kind.items()}
    num = den = 0.0
    for seq in sequences:
        z = [0.0] * len(seq)
        for kind in (True, False):
            idx = [i for i, (k, _) in enumerate(seq) if k == kind]
            if len(idx) >= 2:
                for i, s in zip(idx, normal_scores([seq[i][1] for i in idx]), strict=True):
                    z[i] = s
        if len(z) >= 3:
            num += lag1_correlation(z) * len(z)
            den += len(z)
    rho = min(0.99, max(0.0, num / den)) if den else 0.0
    return grids[True], grids[False], rho


class StepJitter:
    """One worker's step factors: draw ``factor(has_prefill)`` once per step, in step order.

    Deterministic for a given ``random.Random``: the simulator seeds one per worker."""

    def __init__(
        self, prefill: Sequence[float], decode: Sequence[float], rho: float, rng: random.Random
    ) -> None:
        if not 0 <= rho < 1:
            raise ValueError("jitter correlation must be in [0, 1)")
        self.grids = {
            True: quantile_grid_checked("prefill jitter", prefill),
            False: quantile_grid_checked("decode jitter", decode),
        }
        self.rho = rho
        self._innov = math.sqrt(1 - rho * rho)
        self.rng = rng
        self.state = rng.gauss(0.0, 1.0)

    def factor(self, has_prefill: bool) -> float:
        self.state = self.rho * self.state + self._innov * self.rng.gauss(0.0, 1.0)
        grid = self.grids[has_prefill]
        if not grid:
            return 1.0
        return _at(grid, _NORMAL.cdf(self.state))
