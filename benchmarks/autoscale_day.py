"""The pool planner over a day at 64 simulated GPUs (``pdserve simulate --fluid --autoscale``),
against the best static layout at equal attainment; first, the fluid model against the event
simulator on the workload of ``benchmarks/autoscale.py``, where both can run.

    .venv/bin/python -m benchmarks.autoscale_day                # about 45 minutes on 2 cores
    .venv/bin/python -m benchmarks.autoscale_day --check-only   # the model check (about 8 minutes)
    .venv/bin/python -m benchmarks.autoscale_day --oracle-only  # hindsight layouts (about 20 s)
    .venv/bin/python -m benchmarks.autoscale_day --steady 200,400,700  # cycling at 64 GPUs (~30 s)

(How far below the static layout any planner can go on this day: ``benchmarks/day_bound.py``.)

Day workload: the Azure conversation trace's requests and arrival pattern, its mean rate along a
diurnal curve — ``--rate`` req/s at 04:00, rising as a cosine to ``--swing`` × that at 16:00
and back (hourly points, linear between them). SLO TTFT 250 ms / TPOT 100 ms at 90 %; routing
as an SLO-bound deployment runs it (goodput placement, ``--admission reject``, no local
prefill). The planner runs with its defaults (30 s decisions, two checks between, 20 s worker
start-up), from 1P+1D, within ``--max-prefill`` / ``--max-decode`` (together 64 GPUs).

The best static layout at equal attainment: the fewest workers whose day attainment is at
least the autoscaled run's, each total split as the planner's capacity model says serves the
peak best or with one prefill worker more (``static_day``); totals are bisected between a few
under the autoscaled run's largest layout and its mean, each run of the whole day ending early
once its misses pass what that attainment allows. ``--static-at N --target A`` runs that test
for one total alone.

Final JSON line: ``gpu_hours_ratio`` (autoscaled over the static layout's; target <= 0.7), the
attainment of both, the planner's changes, the longest decision (wall), and the check's
``fluid_event_agreement`` (share of 30 s boundaries at which the fluid model's autoscaled
layout is within one worker of the event simulator's) and attainment differences.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from benchmarks.autoscale import SLO, TRACE
from benchmarks.autoscale import run as run_event
from benchmarks.common import emit
from pdserve.model_runtime.backend import GPU_MAX_SEQS
from pdserve.planning.capacity import predict
from pdserve.planning.fluid_run import simulate_fluid
from pdserve.planning.simulate import add_simulate_args
from pdserve.router.workload_window import Workload
from pdserve.simulator.calibration import load_sim_profile

ROUTING = ["--policy", "goodput", "--admission", "reject", "--no-local-prefill"]
DAY = 86_400.0


def parse(flags: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    return p.parse_args(flags)


def fluid(flags: list[str], stop_below: float | None = None, progress: bool = False) -> dict[str, Any]:
    args = parse([*flags, "--fluid"])
    args.stop_below = stop_below
    return simulate_fluid(args, progress=progress)


def diurnal(swing: float) -> str:
    """Hourly points of a cosine day: 1 at 04:00, ``swing`` at 16:00."""
    pts = [(h * 3600, 1 + (swing - 1) * (1 - math.cos(2 * math.pi * (h - 4) / 24)) / 2) for h in range(25)]
    return ",".join(f"{t}:{x:.4f}" for t, x in pts)


def at_boundaries(layouts: list[Any], interval: float, until: float) -> list[tuple[int, int]]:
    out, i, cur = [], 0, (1, 1)
    for k in range(1, int(until // interval) + 1):
        while i < len(layouts) and layouts[i][0] <= k * interval + 1e-6:
            cur = (layouts[i][1], layouts[i][2])
            i += 1
        out.append(cur)
    return out


SMALL = ["--trace", str(TRACE), "--request-rate", "20", "--rate-curve", "0:1,200:1,210:4,450:4,460:1",
         "--duration", "900", *SLO, *ROUTING]  # fmt: skip


def oracle(interval: float = 30.0, static: tuple[int, int] = (2, 2)) -> dict[str, Any]:
    """On ``benchmarks/autoscale.py``'s workload: each static layout up to 5P+3D replayed with the
    planner's windows (its bounds pinned), then per window the fewest workers whose layout met
    90 % there (a window with nothing ended asks nothing) — the layouts a planner moving
    instantly with hindsight would hold, and their GPU-seconds against ``static``'s."""
    windows: dict[tuple[int, int], list[Any]] = {}
    for p in range(1, 6):
        for d in range(1, 4):
            pin = [
                "--min-prefill",
                str(p),
                "--max-prefill",
                str(p),
                "--min-decode",
                str(d),
                "--max-decode",
                str(d),
            ]
            m = fluid([*SMALL, "--prefill", str(p), "--decode", str(d), "--autoscale", *pin])
            windows[(p, d)] = m["autoscale"]["attainment_by_interval"]
    held, seconds, good, ended = [], 0.0, 0.0, 0
    for i in range(min(len(w) for w in windows.values())):
        ok = [(p + d, p, d) for (p, d), w in windows.items() if not w[i][1] < 0.9]
        _, p, d = min(ok) if ok else max((p + d, p, d) for p, d in windows)
        held.append(f"{p}P+{d}D")
        seconds += (p + d) * interval
        _, att, n = windows[(p, d)][i]
        if n:
            good, ended = good + att * n, ended + n
    return {
        "oracle_layouts": held,
        "oracle_attainment": round(good / ended, 4),
        "oracle_worker_seconds_ratio": round(seconds / (sum(static) * interval * len(held)), 3),
    }


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The fluid model against the event simulator on ``benchmarks/autoscale.py``'s workload."""
    base = SMALL
    out: dict[str, Any] = {"check_workload": "benchmarks/autoscale.py's: 20 req/s, 4x step 210-450 s, 900 s"}
    statics = []
    for p, d in ((1, 1), (2, 1), (2, 2), (3, 2)):
        flags = [*base, "--prefill", str(p), "--decode", str(d)]
        e, f = run_event(flags), fluid(flags)
        statics.append(
            {
                "layout": f"{p}P+{d}D",
                "event": round(e["slo_attainment"], 4),
                "fluid": round(f["slo_attainment"], 4),
            }
        )
        print(
            f"check static {p}P+{d}D: event {e['slo_attainment']:.3f}, fluid {f['slo_attainment']:.3f}",
            flush=True,
        )
    auto = [
        *base,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--autoscale",
        "--max-prefill",
        "8",
        "--max-decode",
        "6",
    ]
    t0 = time.perf_counter()
    e = run_event(auto)
    event_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    f = fluid(auto)
    fluid_s = time.perf_counter() - t0
    ev = at_boundaries(e["autoscale"]["layouts"], 30.0, 900.0)
    fl = at_boundaries(f["autoscale"]["layouts"], 30.0, 900.0)
    agree = [abs(a[0] - b[0]) + abs(a[1] - b[1]) <= 1 for a, b in zip(ev, fl, strict=True)]
    out.update(
        {
            "check_static": statics,
            "check_static_max_gap_pp": round(100 * max(abs(s["event"] - s["fluid"]) for s in statics), 2),
            "check_autoscaled_attainment": {
                "event": round(e["slo_attainment"], 4),
                "fluid": round(f["slo_attainment"], 4),
            },
            "check_autoscaled_worker_seconds": {
                "event": round(e["autoscale"]["worker_seconds"], 1),
                "fluid": round(f["autoscale"]["worker_seconds"], 1),
            },
            "fluid_event_agreement": round(sum(agree) / len(agree), 3),
            "check_layouts": {"event": ev, "fluid": fl},
            "check_wall_s": {"event": round(event_s, 1), "fluid": round(fluid_s, 2)},
        }
    )
    print(
        f"check autoscaled: event {e['slo_attainment']:.3f}, fluid {f['slo_attainment']:.3f}, "
        f"agreement {out['fluid_event_agreement']:.2f}",
        flush=True,
    )
    out.update(oracle())
    print(f"check hindsight layouts: {out['oracle_worker_seconds_ratio']:.3f}x the static 2P+2D", flush=True)
    return out


def split(total: int, peak: Workload, args: argparse.Namespace) -> tuple[int, int]:
    """The split of ``total`` workers the capacity model says serves the peak best. A total
    that serves the peak at no split takes the proportions of the smallest total that does
    (every split's prediction is infinite there, and the tie would go to the fewest prefill
    workers the decode bound allows: not a split anyone would run)."""
    model = load_sim_profile("h100-llama3-8b")

    def best(n: int) -> tuple[float, int]:
        def worst(p: int) -> float:
            pr = predict(model, peak, p, n - p, max_seqs=GPU_MAX_SEQS)  # the simulator's default
            return max(pr.ttft_s / 0.25, pr.tpot_s / 0.1)

        lo, hi = max(1, n - args.max_decode), min(args.max_prefill, n - 1)
        return min((worst(p), p) for p in range(lo, hi + 1))

    w, p = best(total)
    for n in range(total + 1, args.max_prefill + args.max_decode + 1):
        if math.isfinite(w):
            break
        w, q = best(n)
        if math.isfinite(w):
            p = min(args.max_prefill, total - 1, max(1, total - args.max_decode, round(total * q / n)))
    return p, total - p


def compact(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """``by_hour`` rows as ``[hour, attainment, worker-hours]``."""
    return [[r["hour"], r["attainment"], r["worker_hours"]] for r in rows]


def print_hours(name: str, rows: list[dict[str, Any]]) -> None:
    """Where a day's run missed and what it held, hour by hour: a static layout misses at the
    peak alone, a planner every hour alike, at the same average."""
    print(f"{name}, by hour of arrival: hour  requests  attainment  workers held", flush=True)
    for r in rows:
        att = "-" if r["attainment"] is None else f"{r['attainment']:.4f}"
        print(f"  {r['hour']:>4}  {r['requests']:>9,}  {att:>10}  {r['worker_hours']:>8.2f}", flush=True)


def day_flags(args: argparse.Namespace) -> list[str]:
    """The day's workload and SLO flags, without a layout."""
    return ["--trace", str(TRACE), "--request-rate", str(args.rate), "--rate-curve", diurnal(args.swing),
            "--duration", str(args.hours * 3600), *SLO, *ROUTING]  # fmt: skip


def day_peak(args: argparse.Namespace) -> Workload:
    """The day's peak load as the capacity model prices it: the trace's mean lengths."""
    prompt_mean, output_mean, prompt_p90 = 1154.7, 211.1, 2734.0  # the trace's
    return Workload(args.rate * args.swing, prompt_mean, output_mean, prompt_tail_tokens=prompt_p90)


def static_day(
    total: int,
    target: float,
    base: list[str],
    peak: Workload,
    args: argparse.Namespace,
    tried: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """The static day of ``total`` workers reaching ``target`` (its ``fluid`` result with its
    split), or None. Two splits are tried, the capacity model's best for the peak and one
    prefill worker more: at high totals ``split`` gives decode workers the peak does not use
    (50 as 30P+20D fell short where 31P+19D passed), and a static layout split worse than it
    could be flatters the planner it is compared with. Each try is appended to ``tried``."""
    p0, d0 = split(total, peak, args)
    for p, d in ((p0, d0), (p0 + 1, d0 - 1)):
        if d < 1 or p > args.max_prefill:
            continue
        t0 = time.perf_counter()
        m = fluid([*base, "--prefill", str(p), "--decode", str(d)], stop_below=target)
        tried.append(
            {
                "layout": f"{p}P+{d}D",
                "attainment": round(m["slo_attainment"], 4),
                "ended_early": m["stopped_early"],
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
        shown = f"{'< ' if m['stopped_early'] else ''}{m['slo_attainment']:.4f}"
        print(f"day static {p}P+{d}D: attainment {shown}", flush=True)
        if not m["stopped_early"] and m["slo_attainment"] >= target:
            return {"prefill": p, "decode": d, **m}
    return None


def day(args: argparse.Namespace) -> dict[str, Any]:
    base = day_flags(args)
    bounds = ["--max-prefill", str(args.max_prefill), "--max-decode", str(args.max_decode)]
    t0 = time.perf_counter()
    spend = ["--autoscale-spend", str(args.spend)]
    auto = fluid([*base, "--prefill", "1", "--decode", "1", "--autoscale", *bounds, *spend], progress=True)
    auto_s = time.perf_counter() - t0
    a = auto["autoscale"]
    target = auto["slo_attainment"]
    peak_layout = max(a["layouts"], key=lambda x: x[1] + x[2])
    print(
        f"day autoscaled: attainment {target:.4f}, {a['worker_seconds'] / 3600:,.0f} GPU-h, "
        f"{a['changes']} changes, largest {peak_layout[1]}P+{peak_layout[2]}D ({auto_s:.0f} s)",
        flush=True,
    )
    print_hours("autoscaled", auto["by_hour"])
    peak = day_peak(args)
    tried: list[dict[str, Any]] = []
    results: dict[int, dict[str, Any]] = {}

    def static(total: int) -> bool:
        m = static_day(total, target, base, peak, args, tried)
        if m is not None:
            results[total] = m
        return m is not None

    # the fewest workers that pass, by bisection: from a few under the autoscaled run's largest
    # layout (up while it fails) down to its mean (the static layout below which none can pass
    # bar a miracle: tried, and the search goes on down if it does pass)
    top = args.max_prefill + args.max_decode
    hi = max(2, peak_layout[1] + peak_layout[2] - 3)
    while hi < top and not static(hi):
        hi += 1
    lo = max(1, min(hi - 1, int(a["worker_seconds"] / auto["duration"])))
    while lo > 1 and static(lo):
        hi, lo = lo, lo - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if static(mid) else (mid, hi)
    total = hi
    best = results.get(total)
    out: dict[str, Any] = {
        "day_workload": f"Azure conversation trace, {args.rate:g} req/s x diurnal cosine 1..{args.swing:g} "
        f"(04:00 trough, 16:00 peak), {args.hours:g} h, {auto['num_prompts']:,} requests",
        "day_autoscaled_attainment": round(target, 4),
        "day_autoscaled_gpu_hours": round(a["worker_seconds"] / 3600, 1),
        "day_changes": a["changes"],
        "day_decisions": a["decisions"],
        "day_largest_layout": f"{peak_layout[1]}P+{peak_layout[2]}D",
        "day_layouts_hourly": [x for x in a["layouts"] if x[0] % 3600 < a["interval_s"]],
        "day_static_tried": tried,
        "day_autoscaled_wall_s": round(auto_s, 1),
        "day_autoscaled_by_hour": compact(auto["by_hour"]),
    }
    if best is not None:
        p, d = best["prefill"], best["decode"]
        print_hours(f"static {p}P+{d}D", best["by_hour"])
        out["day_static_by_hour"] = compact(best["by_hour"])
        static_h = (p + d) * best["duration"] / 3600
        out.update(
            {
                "best_static": f"{p}P+{d}D",
                "static_attainment": round(best["slo_attainment"], 4),
                "static_gpu_hours": round(static_h, 1),
                "gpu_hours_ratio": round(a["worker_seconds"] / 3600 / static_h, 3),
            }
        )
    return out


def steady(rates: list[float], args: argparse.Namespace) -> dict[str, Any]:
    """The planner at a steady load within the day's bounds: 1,500 s of the trace at each rate
    from 1P+1D; what it changes after the first 300 s is cycling (the load does not move)."""
    out = []
    for rate in rates:
        m = fluid(
            ["--trace", str(TRACE), "--request-rate", str(rate), "--duration", "1500", *SLO, *ROUTING,
             "--prefill", "1", "--decode", "1", "--autoscale", "--max-prefill", str(args.max_prefill),
             "--max-decode", str(args.max_decode)]
        )  # fmt: skip
        a = m["autoscale"]
        late = [r for r in a["reasons"] if r[0] > 300]
        row = {
            "rate": rate,
            "attainment": round(m["slo_attainment"], 4),
            "worker_seconds": round(a["worker_seconds"]),
            "changes_after_300s": len(late),
            "changes_per_5_intervals": round(5 * len(late) / ((1500 - 300) / a["interval_s"]), 2),
            "final_layout": f"{a['layouts'][-1][1]}P+{a['layouts'][-1][2]}D",
        }
        print(f"steady {rate:g} req/s: {row}", flush=True)
        out.append(row)
    return {"steady": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=250.0, help="req/s at the trough")
    ap.add_argument("--swing", type=float, default=4.0, help="peak over trough")
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--max-prefill", type=int, default=40)
    ap.add_argument("--max-decode", type=int, default=24)
    ap.add_argument("--spend", type=float, default=0.0, help="--autoscale-spend of the autoscaled day")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument(
        "--oracle-only", action="store_true", help="only the hindsight layouts of the check's workload"
    )
    ap.add_argument(
        "--steady", default="", help="only the steady-load runs at these rates (req/s, comma-separated)"
    )
    ap.add_argument(
        "--static-at",
        type=int,
        default=0,
        help="only the static search's test of this many workers, against --target",
    )
    ap.add_argument("--target", type=float, default=math.nan, help="the attainment --static-at must reach")
    args = ap.parse_args()
    if args.static_at and not (
        0 < args.target <= 1 and 2 <= args.static_at <= args.max_prefill + args.max_decode
    ):
        ap.error("--static-at needs 2 to --max-prefill + --max-decode workers and a --target in (0, 1]")
    t0 = time.perf_counter()
    result: dict[str, Any] = {"slo": "ttft:250 tpot:100 at 90 %", "routing": "goodput, admission reject"}
    if args.static_at:
        tried: list[dict[str, Any]] = []
        m = static_day(args.static_at, args.target, day_flags(args), day_peak(args), args, tried)
        result.update({"static_at": args.static_at, "target": args.target, "passed": m is not None,
                       "day_static_tried": tried})  # fmt: skip
    elif args.steady:
        result.update(steady([float(r) for r in args.steady.split(",")], args))
    elif args.oracle_only:
        result.update(oracle())
    elif not args.skip_check:
        result.update(check(args))
    if not (args.check_only or args.oracle_only or args.steady or args.static_at):
        result.update(day(args))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
