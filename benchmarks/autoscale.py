"""The pool planner against the best static layout, on a trace with a several-fold load swing
(simulated: ``pdserve simulate --autoscale``, the real role engines and router on emulated H100
timing; the planner is the code ``pdserve serve --autoscale`` runs).

    .venv/bin/python -m benchmarks.autoscale                 # about 10 minutes on 2 cores
    .venv/bin/python -m benchmarks.autoscale --quick         # a 400 s trace

Workload: the Azure conversation trace's requests and arrival pattern at ``--rate`` req/s,
shaped by ``--curve`` (default: steady, then a step to 4x, 4x for a while, a step back down).
SLO: TTFT 250 ms / TPOT 100 ms at 90 % (DistServe's goodput definition). Routing, the same for
both layouts: ``--policy goodput --admission reject`` without local prefill (a request predicted
to miss is refused at once, and counts as a miss).

The ceiling in the same run is the best static layout for the same trace: layouts by total
workers, every split of a total, up to the first total with attainment >= 90 % (the fewest
workers meeting it; ties: the higher attainment). Then the autoscaled run, starting at the
minimum. Reported (final JSON):

- ``attainment_gap_pp``: static attainment minus autoscaled, in points (target <= 5);
- ``worker_seconds_ratio``: autoscaled GPU-seconds over the static layout's (target <= 0.75);
- ``step_to_target_s``: from the step up to the end of the first planner interval back at
  >= 90 % attainment (target <= 2 intervals + 10 s);
- ``changes_per_5_intervals``: planner changes per 5 intervals while the load is steady at its
  peak (target <= 1).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import emit
from pdserve.planning.simulate import add_simulate_args, simulate

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/AzureLLMInferenceTrace_conv_2023.csv"
SLO = ["--goodput", "ttft:250", "tpot:100"]


def run(flags: list[str], stop_below: float | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    args = p.parse_args(flags)
    args.stop_below = stop_below  # a layout that can no longer reach it ends early
    args.stop_on_pass = False  # one that passes runs to its end: its worker-seconds are compared
    return simulate(args)


def workload(args: argparse.Namespace) -> list[str]:
    return ["--trace", str(TRACE), "--request-rate", str(args.rate), "--rate-curve", args.curve,
            "--duration", str(args.duration), *SLO]  # fmt: skip


def step_to_target(windows: Sequence[tuple[float, float]], step_at: float) -> float | None:
    """Seconds from the step to the end of the first window back at >= 90 % attainment after
    one that missed it (``windows``: (end time, attainment)); 0.0 when no window after the step
    missed, None when attainment never came back."""
    missed = [t for t, att in windows if t > step_at and att < 0.9]
    if not missed:
        return 0.0
    back = next((t for t, att in windows if t > missed[0] and att >= 0.9), None)
    return None if back is None else back - step_at


def best_static(
    base: list[str], max_prefill: int, max_decode: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The best static layout for the whole workload ``base``: the fewest workers meeting 90 %
    (ties: the higher attainment), else the highest attainment of all. Layouts are tried by
    total workers, every split of a total, up to the first total that meets; a layout ends
    early once it can no longer reach 90 % (its attainment then is the most it could still
    have reached — so when none meets, the pick among them is by those bounds, and only the
    pick is run again to its end)."""
    static: list[dict[str, Any]] = []
    for n in range(2, max_prefill + max_decode + 1):
        for p in range(max(1, n - max_decode), min(max_prefill, n - 1) + 1):
            d = n - p
            m = run([*base, "--prefill", str(p), "--decode", str(d)], stop_below=0.9)
            static.append({"prefill": p, "decode": d, "workers": n, "attainment": m["slo_attainment"],
                           "worker_seconds": m["worker_seconds"],
                           "ended_early": bool(m.get("stopped_early"))})  # fmt: skip
            seen = "< 0.900 (ended early)" if m.get("stopped_early") else f"{m['slo_attainment']:.3f}"
            print(f"static {p}P+{d}D: attainment {seen}", flush=True)
        if any(s["attainment"] >= 0.9 for s in static):
            break
    meeting = [s for s in static if s["attainment"] >= 0.9]
    best = (
        min(meeting, key=lambda s: (s["workers"], -s["attainment"]))
        if meeting
        else max(static, key=lambda s: s["attainment"])
    )
    if best["ended_early"]:  # nothing met: the comparison needs the whole run of the best
        m = run([*base, "--prefill", str(best["prefill"]), "--decode", str(best["decode"])])
        best.update(attainment=m["slo_attainment"], worker_seconds=m["worker_seconds"], ended_early=False)
    print(
        f"best static: {best['prefill']}P+{best['decode']}D, attainment {best['attainment']:.3f}", flush=True
    )
    return static, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=20.0, help="the curve's base rate (req/s)")
    ap.add_argument("--curve", default="0:1,200:1,210:4,450:4,460:1", help="--rate-curve of the run")
    ap.add_argument("--duration", type=float, default=900.0)
    ap.add_argument("--step-at", type=float, default=210.0, help="where the curve reaches its peak")
    ap.add_argument("--steady", default="300:450", help="the peak's steady stretch, for the change count")
    ap.add_argument("--max-prefill", type=int, default=8)
    ap.add_argument("--max-decode", type=int, default=6)
    ap.add_argument("--interval", type=float, default=30.0)
    ap.add_argument("--start-s", type=float, default=20.0, help="a new worker's start-up")
    ap.add_argument("--quick", action="store_true", help="a 400 s trace, the step at 100 s")
    # The router as an SLO-bound deployment runs it: goodput routing that refuses a request it
    # predicts to miss (a backlog is not left to poison the next minute), pure disaggregation
    # (what the planner sizes the pools for).
    ap.add_argument("--policy", default="goodput", help="routing, for the static and autoscaled runs")
    ap.add_argument("--admission", default="reject", help="what the router does with a request bound to miss")
    ap.add_argument("--local-prefill", action="store_true", help="goodput policy: decode workers may prefill")
    ap.add_argument("--spend", type=float, default=0.0, help="--autoscale-spend of the autoscaled run")
    args = ap.parse_args()
    if args.quick:
        args.curve, args.duration, args.step_at, args.steady = (
            "0:1,90:1,100:4,220:4,230:1",
            400.0,
            100.0,
            "160:220",
        )
    t0 = time.perf_counter()
    routing = ["--policy", args.policy, "--admission", args.admission]
    base = [*workload(args), *routing, *([] if args.local_prefill else ["--no-local-prefill"])]
    static, best = best_static(base, args.max_prefill, args.max_decode)
    bounds = ["--max-prefill", str(args.max_prefill), "--max-decode", str(args.max_decode)]
    timing = ["--autoscale-interval", str(args.interval), "--worker-start-s", str(args.start_s)]
    auto = run(
        [
            *base,
            "--prefill",
            "1",
            "--decode",
            "1",
            "--autoscale",
            *bounds,
            *timing,
            "--autoscale-spend",
            str(args.spend),
        ]
    )
    a = auto["autoscale"]
    windows = [(t, att) for t, att, n in a["attainment_by_interval"] if n]
    lo, hi = (float(x) for x in args.steady.split(":"))
    steady_changes = [r for r in a["reasons"] if lo <= r[0] <= hi]
    intervals = (hi - lo) / args.interval
    result = {
        "workload": f"Azure conversation trace, {args.rate} req/s x curve {args.curve}, {args.duration:g} s",
        "slo": "ttft:250 tpot:100 at 90 %",
        "routing": f"{args.policy}, admission {args.admission}",
        "spend": args.spend,
        "best_static": f"{best['prefill']}P+{best['decode']}D",
        "static_attainment": round(best["attainment"], 4),
        "autoscaled_attainment": round(auto["slo_attainment"], 4),
        "attainment_gap_pp": round(100 * (best["attainment"] - auto["slo_attainment"]), 2),
        "static_worker_seconds": round(best["worker_seconds"], 1),
        "autoscaled_worker_seconds": round(a["worker_seconds"], 1),
        "worker_seconds_ratio": round(a["worker_seconds"] / best["worker_seconds"], 3),
        "step_to_target_s": step_to_target(windows, args.step_at),
        "changes_per_5_intervals": round(5 * len(steady_changes) / intervals, 2) if intervals else None,
        "changes": a["changes"],
        "decisions": a["decisions"],
        "interval_s": args.interval,
        "worker_start_s": args.start_s,
        "changes_log": a["reasons"],
        "attainment_by_interval": windows,
        "static_layouts": static,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
