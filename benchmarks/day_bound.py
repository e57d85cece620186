"""How far below a static layout a planner that holds the static layout's attainment in every
hour can go on ``benchmarks/autoscale_day.py``'s day: the hindsight bound on GPU-hours.

    .venv/bin/python -m benchmarks.day_bound --static 28P+19D     # about 15 minutes on 2 cores

First the static layout runs the whole day (``pdserve simulate --fluid``, the day's workload and
routing): its attainment ``A`` and GPU-hours are the ceiling compared with. Then, at each hourly
point of the diurnal curve, the fewest workers whose layout meets ``A`` at that point's rate held
steady (``--steady-s`` of the trace, static; three splits searched: the fewest decode workers
that meet with prefill at its bound, then the fewest prefill workers for that decode pool and
for one and two decode workers more; a split with still more decode workers is not tried):
what a planner moving with hindsight, between perfectly steady hours, would hold to meet ``A``
in every hour.

The rate moves linearly between the hourly points, so the hour from one point to the next
needs, at most, the larger of the two points' layouts and, at least, the smaller: the day's
GPU-hours lie between the sum of the smaller ones (``bound_lower``) and of the larger ones
(``bound_upper``), the sum of the points (``bound_points``) between them. A planner meeting
``A`` every hour with the layouts found here cannot go below ``bound_lower``. The day's
attainment is what the target is judged on, and hours can be traded against each other, so
this bounds planners that hold ``A`` hour by hour, not every planner.

Final JSON line: the static layout's attainment and GPU-hours, the hourly layouts, and the three
sums with their ratios to the static layout's GPU-hours.
"""

from __future__ import annotations

import argparse
import functools
import re
import time
from typing import Any

from benchmarks.autoscale import SLO, TRACE
from benchmarks.autoscale_day import DAY, ROUTING, diurnal, fluid
from benchmarks.common import emit
from pdserve.planning.keep_up import fewest_passing


def parse_layout(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)P\+(\d+)D", text.strip().upper())
    if m is None or min(int(m[1]), int(m[2])) < 1:
        raise argparse.ArgumentTypeError(f"a layout is written like 28P+19D, got {text!r}")
    return int(m[1]), int(m[2])


def hourly_rates(base: float, swing: float) -> list[float]:
    """The curve's 24 hourly points, in req/s (hour 0 first)."""
    return [base * float(pt.split(":")[1]) for pt in diurnal(swing).split(",")[:24]]


def hour_sums(workers: list[int]) -> dict[str, int]:
    """The day's worker-hours from the workers each hourly point needs (the day wraps: the
    last hour runs into the first point): each hour at the smaller of its two ends, at its own
    point, and at the larger."""
    pairs = list(zip(workers, workers[1:] + workers[:1], strict=True))
    return {
        "bound_lower": sum(min(a, b) for a, b in pairs),
        "bound_points": sum(workers),
        "bound_upper": sum(max(a, b) for a, b in pairs),
    }


def smallest(rate: float, target: float, args: argparse.Namespace, memo: dict[Any, float]) -> tuple[int, int]:
    """The fewest workers (then the fewest prefill) meeting ``target`` at ``rate`` held steady."""

    def attainment(p: int, d: int) -> float:
        if (rate, p, d) not in memo:
            m = fluid(
                ["--trace", str(TRACE), "--request-rate", f"{rate:.3f}", "--duration", str(args.steady_s),
                 *SLO, *ROUTING, "--prefill", str(p), "--decode", str(d)]
            )  # fmt: skip
            memo[(rate, p, d)] = m["slo_attainment"]
        return memo[(rate, p, d)]

    def meets(p: int, d: int) -> bool:
        return attainment(p, d) >= target

    d0 = fewest_passing(1, args.max_decode, lambda d: attainment(args.max_prefill, d) >= target)
    if d0 is None:
        bound = f"{args.max_prefill}P+{args.max_decode}D"
        raise SystemExit(f"no layout within {bound} meets {target} at {rate} req/s")
    found = []
    for d in range(d0, min(args.max_decode, d0 + 2) + 1):
        p = fewest_passing(1, args.max_prefill, functools.partial(meets, d=d))
        if p is not None:
            found.append((p + d, p, d))
    _, p, d = min(found)
    return p, d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--static", type=parse_layout, required=True, help="the static layout, e.g. 28P+19D")
    ap.add_argument("--rate", type=float, default=250.0, help="req/s at the trough (as autoscale_day)")
    ap.add_argument("--swing", type=float, default=4.0, help="peak over trough (as autoscale_day)")
    ap.add_argument("--max-prefill", type=int, default=40)
    ap.add_argument("--max-decode", type=int, default=24)
    ap.add_argument("--steady-s", type=float, default=600.0, help="seconds of steady load per hourly point")
    ap.add_argument("--attainment", type=float, default=None, help="skip the static day: hold this instead")
    args = ap.parse_args()
    if not args.steady_s > 0 or (args.attainment is not None and not 0 < args.attainment < 1):
        ap.error("--steady-s must be > 0 and --attainment a share in (0, 1)")
    t0 = time.perf_counter()
    p, d = args.static
    result: dict[str, Any] = {
        "workload": f"Azure conversation trace, {args.rate:g} req/s x diurnal cosine 1..{args.swing:g}, 24 h",
        "static": f"{p}P+{d}D",
        "static_gpu_hours": float(p + d) * DAY / 3600,
    }
    if args.attainment is None:
        day = fluid(
            ["--trace", str(TRACE), "--request-rate", str(args.rate), "--rate-curve", diurnal(args.swing),
             "--duration", str(DAY), *SLO, *ROUTING, "--prefill", str(p), "--decode", str(d)],
            progress=True,
        )  # fmt: skip
        target = day["slo_attainment"]
        print(f"static {p}P+{d}D over the day: attainment {target:.4f}", flush=True)
    else:
        target = args.attainment
    result["attainment"] = round(target, 4)
    memo: dict[Any, float] = {}
    by_rate: dict[float, tuple[int, int]] = {}
    hours = []
    for h, rate in enumerate(hourly_rates(args.rate, args.swing)):
        key = round(rate, 3)
        if key not in by_rate:
            by_rate[key] = smallest(rate, target, args, memo)
            print(f"{h:02d}:00 {rate:7.1f} req/s: {by_rate[key][0]}P+{by_rate[key][1]}D", flush=True)
        hours.append(by_rate[key])
    sums = hour_sums([p + d for p, d in hours])
    result["hourly_layouts"] = [f"{p}P+{d}D" for p, d in hours]
    for k, v in sums.items():
        result[f"{k}_gpu_hours"] = v
        result[f"{k}_ratio"] = round(v / result["static_gpu_hours"], 3)
    result["steady_runs"] = len(memo)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
