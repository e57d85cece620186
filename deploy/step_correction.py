"""What the planner learns from the tails it measured: a correction of the model (pure).

The step-time model (``pdserve.steptime``) is a profile, and the capacity model
(``pdserve.deploy.capacity``) is closed-form queueing on it; the workers serving may be slower
than the profile (a busier host, a throttled GPU, an engine's own overhead), and the tails they
serve carry what the queueing formula leaves out. The planner corrects both by what the layout
that served each window measured, so that it prices the next load as these workers would serve
it. Each phase has a factor on the step time and a fixed part:

- **prefill**: a factor on the step time and an offset added to the TTFT tail (``fit_prefill``),
  fitted to the last windows' measured TTFT tails, each priced at the layout and load that
  served it. A factor prices a pool as slower at every load: its utilisation, so its queue,
  grows with it, and a factor learned where the pool is lightly loaded prices a busier pool
  close to saturation. What the tail carries beyond the model is mostly not that: the router's
  hops and the hand-off, the trace's bursts (arrivals burstier than the Poisson arrivals the
  queueing formula assumes), a quantile of a bimodal prompt mix. Measured against the model,
  that excess stayed about the same from a pool at 0.3 utilisation to one at 0.65, while the
  model's own prediction moved with the window's prompt tail, so a factor fitted to it alone
  priced a peak's pool a worker larger than the one that served it. Windows at different loads
  and prompt tails tell the two apart; what windows cannot tell apart is read as the factor
  (the safe reading: a pool that saturates sooner);
- **decode**: a factor *and* a fixed cost a step, ``factor · model(batch) + fixed`` (``fit_decode``),
  fitted to the last windows' measured TPOTs, each at the batch Little's law puts on a worker
  for it (``capacity.decode_step_at``). A decode step's overhead is partly per step (launches,
  scheduling, sampling, streaming), and a factor alone, learned at a trough's small batches,
  prices a peak's large batches as that much slower: a decode pool sized for a load it keeps
  up with. Windows at one batch size cannot tell the two apart; the fit then splits the excess
  evenly between them, and windows at other batch sizes separate them.

No part goes below the model (a factor under 1, a negative offset or fixed cost): tails under
the model's would read as workers faster than their profile and price a step's load as one the
pool keeps up with; the router's own factors (goodput routing) correct the step time both ways,
request by request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MOST = 4.0  # the largest factor learned, and the largest fixed cost in model steps
_RIDGE = 1e-3  # the pull toward an even split when windows cannot separate factor and fixed cost
# prefill (``fit_prefill``): a ridge too small to move what the windows tell apart, and its
# pull on the offset against the factor's, which decides what they cannot
_PREFILL_RIDGE = 1e-6
_OFFSET_RIDGE = 100.0


@dataclass(frozen=True)
class StepCorrection:
    prefill: float = 1.0  # a factor on the prefill step time
    decode: float = 1.0  # a factor on the decode step time
    decode_fixed_s: float = 0.0  # added to every decode step
    ttft_offset_s: float = 0.0  # added to the TTFT tail

    def __str__(self) -> str:
        return (
            f"prefill x{self.prefill:.2f} + {self.ttft_offset_s * 1e3:.0f} ms, "
            f"decode x{self.decode:.2f} + {self.decode_fixed_s * 1e3:.1f} ms"
        )


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


# the prefill factors ``fit_prefill`` tries: 1 to ``MOST`` in steps of about 5 %
_FACTORS = tuple(MOST ** (i / 28) for i in range(29))


def fit_prefill(tails: Sequence[Callable[[float], float]], measured: Sequence[float]) -> tuple[float, float]:
    """(factor, offset seconds) with ``tail(factor) + offset`` nearest each window's measured
    TTFT tail in relative terms, where ``tails[i](f)`` is window ``i``'s TTFT tail predicted
    with the prefill step time scaled by ``f`` (increasing in it, infinite where the pool would
    not keep up): least squares with a small ridge toward the model, heavier on the offset; the
    factor on a grid of about 5 % in [1, ``MOST``] (and each window's own, ``solve``), the offset
    in [0, the windows' mean tail at factor 1]; (1, 0) with no usable window. A window more than
    1,000 times off the model is left out (a stalled window, not a tail), and a factor at which
    a window's tail is unbounded is not one that served it."""
    pts = [(tail, m) for tail, m in zip(tails, measured, strict=True) if m > 0 and math.isfinite(m)]
    pts = [(tail, m) for tail, m in pts if 1e-3 <= m / max(tail(1.0), 1e-12) <= 1e3]
    if not pts:
        return 1.0, 0.0
    scale = sum(m for _, m in pts) / len(pts)
    # an excess beyond the model's own tail is a queue it did not see, which more workers
    # shorten, not a cost every layout pays: the offset stays within the mean tail predicted
    top = sum(tail(1.0) for tail, _ in pts) / len(pts)
    # on (factor - 1), and on the offset in units of the mean tail, heavier: what the windows
    # cannot tell apart is read as the factor (the safe reading: a pool that saturates sooner)
    ridge = _PREFILL_RIDGE * len(pts)
    w = [1 / (m * m) for _, m in pts]
    best = (math.inf, 1.0, 0.0)
    # the grid, and each window's own factor (the one under which it alone predicts its tail):
    # near saturation a tail grows steeply, and an excess only a factor there explains (a
    # queue the model did not see) is not an offset every layout would pay
    for f in sorted({*_FACTORS, *(solve(tail, m) for tail, m in pts)}):
        model = [tail(f) for tail, _ in pts]
        if not all(math.isfinite(x) for x in model):
            break  # a larger factor saturates it too
        # for this factor the nearest offset is closed-form (least squares in ``off``)
        num = sum(wi * (m - x) for wi, (_, m), x in zip(w, pts, model, strict=True))
        off = _clip(num / (sum(w) + _OFFSET_RIDGE * ridge / scale**2), 0.0, top)
        cost = sum(((x + off - m) / m) ** 2 for (_, m), x in zip(pts, model, strict=True))
        cost += ridge * ((f - 1) ** 2 + _OFFSET_RIDGE * (off / scale) ** 2)
        if cost < best[0]:
            best = (cost, f, off)
    return best[1], best[2]


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
