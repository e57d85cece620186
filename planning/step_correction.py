"""What the planner learns from the tails it measured: a correction of the model's step times (pure).

The step-time model (``pdserve.steptime``) is a profile; the workers serving may be slower (a
busier host, a throttled GPU, an engine's own overhead). The planner corrects the model by what
the layout that served a window measured, so that it prices the next load as these workers
would serve it:

- **prefill**: a factor on the step time (``solve``): the one under which the window's layout
  predicts the TTFT tail measured, half the way from the last (one noisy window moves it half);
- **decode**: a factor *and* a fixed cost a step, ``factor · model(batch) + fixed`` (``fit_decode``),
  fitted to the last windows' measured TPOTs, each at the batch Little's law puts on a worker
  for it (``capacity.decode_step_at``). A decode step's overhead is partly per step (launches,
  scheduling, sampling, streaming), and a factor alone, learned at a trough's small batches,
  prices a peak's large batches as that much slower: a decode pool sized for a load it keeps
  up with. Windows at one batch size cannot tell the two apart; the fit then splits the excess
  evenly between them (the least change from the model, a ridge), and windows at other batch
  sizes separate them.

Neither part goes below the model (a factor under 1 or a negative fixed cost): tails under the
model's would read as workers faster than their profile and price a step's load as one the pool
keeps up with; the router's own factors (goodput routing) correct the step time both ways,
request by request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MOST = 4.0  # the largest factor learned, and the largest fixed cost in model steps
_RIDGE = 1e-3  # the pull toward an even split when windows cannot separate factor and fixed cost


@dataclass(frozen=True)
class StepCorrection:
    prefill: float = 1.0  # a factor on the prefill step time
    decode: float = 1.0  # a factor on the decode step time
    decode_fixed_s: float = 0.0  # added to every decode step

    def __str__(self) -> str:
        return f"prefill x{self.prefill:.2f}, decode x{self.decode:.2f} + {self.decode_fixed_s * 1e3:.1f} ms"


NONE = StepCorrection()


@dataclass(frozen=True)
class DecodePoint:
    """One window's decode: the model's step time at the batch it ran (the router's factor
    included) and the TPOT measured."""

    model_s: float
    measured_s: float


def fit_decode(points: Sequence[DecodePoint]) -> tuple[float, float]:
    """(factor, fixed seconds) with ``factor · model_s + fixed`` nearest each point's measured
    step in relative terms (least squares on the excess over the model, with a small ridge
    toward it), factor in [1, ``MOST``] and fixed in [0, ``MOST`` × the mean model step]; (1, 0)
    with no usable point. A point more than 1,000 times off the model is left out (a unit error
    or a stalled window, not a step time)."""
    pts = [p for p in points if p.model_s > 0 and 1e-3 <= p.measured_s / p.model_s <= 1e3]
    if not pts:
        return 1.0, 0.0
    scale = sum(p.model_s for p in pts) / len(pts)
    # unknowns u = factor - 1 and v = fixed / scale; each point: u·x + v·y ≈ r (relative to it)
    rows = [(p.model_s / p.measured_s, scale / p.measured_s, 1 - p.model_s / p.measured_s) for p in pts]
    xx, yy = sum(x * x for x, _, _ in rows), sum(y * y for _, y, _ in rows)
    ridge = _RIDGE * (xx + yy) / 2  # relative to the data's own scale
    sxx, syy = xx + ridge, yy + ridge
    sxy = sum(x * y for x, y, _ in rows)
    sxr = sum(x * r for x, _, r in rows)
    syr = sum(y * r for _, y, r in rows)
    det = sxx * syy - sxy * sxy  # > 0: the ridge keeps it so
    u, v = (sxr * syy - syr * sxy) / det, (syr * sxx - sxr * sxy) / det
    top = MOST - 1
    if not (0 <= u <= top and 0 <= v <= MOST):
        # a bound is active: the best along each edge it could be on, and the nearer of those
        edges = []
        for fixed_u in (0.0, top):
            edges.append((fixed_u, _clip((syr - fixed_u * sxy) / syy, 0.0, MOST)))
        for fixed_v in (0.0, MOST):
            edges.append((_clip((sxr - fixed_v * sxy) / sxx, 0.0, top), fixed_v))

        def cost(uv: tuple[float, float]) -> float:
            a, b = uv
            return sum((a * x + b * y - r) ** 2 for x, y, r in rows) + ridge * (a * a + b * b)

        u, v = min(edges, key=cost)
    return 1.0 + u, v * scale


def solve(tail: Callable[[float], float], measured: float, lo: float = 1.0, hi: float = MOST) -> float:
    """The factor in [``lo``, ``hi``] at which ``tail`` (increasing in it, infinite past a
    saturation) equals ``measured``: an end when none does; bisection on the log."""
    if tail(lo) >= measured:
        return lo
    if tail(hi) <= measured:
        return hi
    for _ in range(24):  # a factor of 8 to within 1e-7 of its log
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if tail(mid) > measured else (mid, hi)
    return lo


def _clip(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))
