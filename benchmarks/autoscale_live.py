"""The pool planner live: ``pdserve serve --autoscale`` with emulated-H100 workers (Ray actors on
this machine whose steps take the H100 profile's time), replaying the workload of
``benchmarks/autoscale.py`` (the Azure conversation trace along a rate curve with a 4x step),
against the best static layout of that benchmark run live the same way, and against the
simulated autoscaler's decisions for the same workload.

    .venv/bin/python -m benchmarks.autoscale_live            # about 16 minutes (two 400 s runs)
    .venv/bin/python -m benchmarks.autoscale_live --skip-static

Reported (final JSON line), as ``benchmarks/autoscale.py`` does for the simulation:
``attainment_gap_pp`` (static minus autoscaled), ``worker_seconds_ratio`` (autoscaled over
static; workers counted from the router's status once a second, a starting worker from when it
joins), ``step_to_target_s`` (from the step to the end of the first interval back at >= 90 %,
by the end time of requests, as the planner sees them; ``step_to_target_by_arrival_s`` by their
arrival time, and the static layout's both for the same workload), ``changes_per_5_intervals``
at the steady peak, and ``sim_agreement``: the share of interval boundaries at which the live layout is within
one worker (|dP| + |dD| <= 1) of the simulated autoscaler's on the same workload;
``fluid_agreement``: the same against the request-level model (``pdserve simulate --fluid``);
``live_*_host_cpu_pct``: the host's CPU busy share (median, 90th percentile) while each run's
workload played — the emulated GPUs are what is measured only while the host has room.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import math
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.autoscale import TRACE, best_static, run, step_to_target
from benchmarks.autoscale_day import fluid as fluid_run
from benchmarks.client import free_port, wait_ready
from benchmarks.common import emit
from pdserve.bench.client import PdserveGrpcBackend
from pdserve.bench.metrics import RequestResult, Slo
from pdserve.bench.runner import build_workload
from pdserve.bench.runner import run as replay
from pdserve.bench.workload import RequestSpec
from pdserve.router.workload_window import rank

T = TypeVar("T")

BIN = Path(sys.executable).parent


def specs(args: argparse.Namespace) -> list[RequestSpec]:
    ns = argparse.Namespace(
        seed=0, num_prompts=1000, duration=args.duration, dataset_name="trace", dataset_path=TRACE,
        time_scale=1.0, trace_start=0, rate_curve=args.curve, request_rate=args.rate, burstiness=1.0,
        random_input_len=0, random_output_len=0, random_range_ratio=0.0, vocab_size=256, block_size=16,
    )  # fmt: skip
    return build_workload(ns)


def slo_flags(args: argparse.Namespace) -> list[str]:
    return ["--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.tpot_ms:g}"]


@contextmanager
def serving(
    args: argparse.Namespace, layout: list[str], log: Path
) -> Iterator[tuple[str, str, list[tuple[float, int, int, float]]]]:
    """``pdserve serve`` with ``layout`` flags; yields its gRPC address, its HTTP URL and a
    timeline of (monotonic time, prefill, decode, host CPU busy %) sampled once a second while
    it runs (prefill and decode -1 for a second the status did not answer)."""
    http, grpc_port = free_port(), free_port()
    # INFO: the planner's every decision and the measurements behind it go to the run's log
    cmd = [str(BIN / "pdserve"), "--log-level", "INFO", "serve", "--model", "tiny",
           "--compute", f"emulated:{args.profile}",
           "--policy", "least_loaded", "--no-local-prefill",
           "--slo", f"default:ttft={args.ttft_ms:g},tpot={args.tpot_ms:g}",
           "--max-tokens-cap", "4096", "--http-port", str(http), "--grpc-port", str(grpc_port),
           *layout, *args.serve_flag]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    timeline: list[tuple[float, int, int, float]] = []
    stop = threading.Event()

    def sample() -> None:
        psutil.cpu_percent()  # the next call (this thread's) measures from here
        while not stop.wait(1.0):
            # the whole host's, each second whether or not the status answers (when the host is
            # saturated it may not, and those seconds must count)
            busy = psutil.cpu_percent()
            try:
                roles = [w["role"] for w in httpx.get(f"http://127.0.0.1:{http}/cluster/status", timeout=5)
                         .json()["workers"]]  # fmt: skip
            except (httpx.HTTPError, ValueError, KeyError):
                timeline.append((time.monotonic(), -1, -1, busy))  # workers unknown this second
                continue
            timeline.append((time.monotonic(), roles.count("prefill"), roles.count("decode"), busy))

    try:
        wait_ready(f"http://127.0.0.1:{http}/health", proc, timeout_s=300)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http}", timeline
        stop.set()
        th.join()
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def live_run(args: argparse.Namespace, layout: list[str], log: Path) -> dict[str, Any]:
    slo = Slo.parse(slo_flags(args)[1:])
    work = specs(args)
    with serving(args, layout, log) as (address, url, timeline):

        async def go() -> tuple[list[RequestResult], float]:
            backend = PdserveGrpcBackend(address, None, 0.0)  # its channel belongs to this loop
            try:
                return await replay(work, backend, None, progress=False)
            finally:
                await backend.close()

        t0 = time.monotonic()
        results, _ = asyncio.run(go())
        t_end = time.monotonic()
        counters = moved(url)
    met = [slo.met(r) for r in results]
    ends = [s.arrival_s + r.latency for s, r in zip(work, results, strict=True)]
    arrivals = [s.arrival_s for s in work]
    rel = [(t - t0, p, d) for t, p, d, _ in timeline if t0 <= t <= t_end and p >= 0]
    busy = sorted(b for t, _, _, b in timeline if t0 <= t <= t_end)
    seconds = sum((b[0] - a[0]) * (a[1] + a[2]) for a, b in itertools.pairwise(rel))
    return {
        "attainment": sum(met) / len(met),
        "failed": sum(not r.success for r in results),
        "errors": dict(collections.Counter(r.error[:120] for r in results if not r.success).most_common(5)),
        "requests": len(results),
        "worker_seconds": seconds,
        "windows": by_window(met, ends, args.interval),  # by when requests ended
        "arrival_windows": by_window(met, arrivals, args.interval),  # by when they arrived
        # which target each arrival window's misses broke: where a step's growth fell short
        "arrival_misses": misses_by_window(slo, results, arrivals, args.interval),
        "timeline": rel,
        "moved": counters,
        # the host's CPU while the workload ran: near 100 % the host, not the emulated GPUs,
        # sets the latencies (a dilated profile, ``@xN``, gives it room)
        "host_cpu_median_pct": busy[len(busy) // 2] if busy else math.nan,
        "host_cpu_p90_pct": busy[int(0.9 * (len(busy) - 1))] if busy else math.nan,
    }


MOVED = {
    "pdserve:prefill_rerouted_total": "prompts_rerouted",  # taken back before they started
    "pdserve:request_migrations_total": "streams_migrated",
}


def moved(url: str) -> dict[str, float]:
    """The router's counts of requests it moved (``MOVED``), from its metrics."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
    counts = dict.fromkeys(MOVED.values(), 0.0)
    for s in (s for f in families for s in f.samples if s.name in MOVED):
        counts[MOVED[s.name]] += s.value  # (summed over the labels: each cause of a move)
    return counts


def by_window(met: list[bool], times: list[float], interval: float) -> list[tuple[float, float, int]]:
    """(window end, attainment, requests) of each ``interval`` holding any of ``times``."""
    return [(hi, sum(inside) / len(inside), len(inside)) for hi, inside in _grouped(met, times, interval)]


def misses_by_window(
    slo: Slo, results: list[RequestResult], times: list[float], interval: float
) -> list[tuple[float, int, int, int, int, float]]:
    """(window end, requests, failed, over the TTFT target, over the TPOT target, the TTFT at the
    90th percentile in ms) of each ``interval`` holding any of ``times``; a request over both
    targets counts in both."""
    out = []
    for hi, inside in _grouped(results, times, interval):
        ok = [r for r in inside if r.success]
        ttfts = sorted(r.ttft * 1e3 for r in ok)
        tpots = [r.tpot for r in ok]
        out.append((
            hi,
            len(inside),
            len(inside) - len(ok),
            sum(1 for r in ok if slo.ttft_ms and r.ttft * 1e3 > slo.ttft_ms),
            sum(1 for t in tpots if slo.tpot_ms and t is not None and t * 1e3 > slo.tpot_ms),
            round(ttfts[rank(len(ttfts), 0.9)], 1) if ttfts else math.nan,
        ))  # fmt: skip
    return out


def _grouped(items: list[T], times: list[float], interval: float) -> Iterator[tuple[float, list[T]]]:
    """(window end, the ``items`` whose time falls in it) of each ``interval`` holding any."""
    for k in range(math.ceil(max(times) / interval)):
        lo, hi = k * interval, (k + 1) * interval
        inside = [x for x, t in zip(items, times, strict=True) if lo <= t < hi]
        if inside:
            yield hi, inside


def to_target(run: dict[str, Any], step_at: float) -> dict[str, float | None]:
    """``step_to_target`` of a run by its requests' end (what the planner sees) and by their
    arrival (whether what arrived after the step met: at a dilated profile a request decodes
    for minutes, so windows by end still count the step's backlog long after the layout that
    serves it is in place)."""
    return {
        "by_end": step_to_target([(t, a) for t, a, _ in run["windows"]], step_at),
        "by_arrival": step_to_target([(t, a) for t, a, _ in run["arrival_windows"]], step_at),
    }


def layout_at(series: list[tuple[float, int, int]], t: float) -> tuple[int, int] | None:
    before = [(p, d) for ts, p, d in series if ts <= t]
    return before[-1] if before else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--curve", default="0:1,90:1,100:4,220:4,230:1")
    ap.add_argument("--duration", type=float, default=400.0)
    ap.add_argument("--step-at", type=float, default=100.0)
    ap.add_argument("--steady", default="160:220")
    ap.add_argument(
        "--static",
        default="",
        help="the static layout to compare with (default: the best one, by simulation)",
    )
    ap.add_argument(
        "--profile", default="h100-llama3-8b", help="emulated GPU timing (e.g. h100-llama3-8b@x4)"
    )
    ap.add_argument("--ttft-ms", type=float, default=250.0)
    ap.add_argument("--tpot-ms", type=float, default=100.0)
    ap.add_argument("--interval", type=float, default=30.0)
    ap.add_argument("--max-prefill", type=int, default=6)
    ap.add_argument("--max-decode", type=int, default=4)
    ap.add_argument("--spend", type=float, default=0.0, help="--autoscale-spend of the autoscaled runs")
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--logs", type=Path, default=Path("/tmp"))
    ap.add_argument(
        "--serve-flag", action="append", default=[], metavar="FLAG",
        help="one more 'pdserve serve' flag for the live runs (repeat it), e.g. =--no-prefill-rebalance",
    )  # fmt: skip
    args = ap.parse_args()
    # The simulated runs: the same workload, profile and SLO (the simulator's own arrivals).
    base = ["--trace", str(TRACE), "--request-rate", str(args.rate), "--rate-curve", args.curve,
            "--duration", str(args.duration), "--profile", args.profile, *slo_flags(args)]  # fmt: skip
    if not args.static:
        best = best_static(base, args.max_prefill, args.max_decode)[1]
        args.static = f"{best['prefill']}P+{best['decode']}D"
    p, d = (int(x) for x in re.fullmatch(r"(\d+)P\+(\d+)D", args.static).groups())  # type: ignore[union-attr]
    bounds = ["--max-prefill", str(args.max_prefill), "--max-decode", str(args.max_decode)]
    auto_flags = ["--prefill", "1", "--decode", "1", "--autoscale", *bounds,
                  "--autoscale-interval", str(args.interval),
                  "--autoscale-spend", str(args.spend)]  # fmt: skip
    started = time.perf_counter()
    auto = live_run(args, auto_flags, args.logs / "autoscale-live-auto.log")
    print(
        f"live autoscaled: attainment {auto['attainment']:.3f}, {auto['worker_seconds']:.0f} worker-s",
        flush=True,
    )
    static = None
    if not args.skip_static:
        static = live_run(
            args, ["--prefill", str(p), "--decode", str(d)], args.logs / "autoscale-live-static.log"
        )
        print(f"live static {args.static}: attainment {static['attainment']:.3f}", flush=True)
    bounds_t = [k * args.interval for k in range(1, int(args.duration // args.interval) + 1)]

    def agreement(sim: dict[str, Any]) -> tuple[list[tuple[Any, Any]], list[bool]]:
        """(live, simulated) layouts at the interval boundaries, and which are within one worker."""
        sim_layouts = [(t, pp, dd) for t, pp, dd in sim["layouts"]]
        found = [(layout_at(auto["timeline"], t), layout_at(sim_layouts, t)) for t in bounds_t]
        pairs = [(a, b) for a, b in found if a is not None and b is not None]
        return pairs, [abs(a[0] - b[0]) + abs(a[1] - b[1]) <= 1 for a, b in pairs]

    sim_flags = [*base, "--policy", "least_loaded", *auto_flags]
    pairs, agree = agreement(run(sim_flags)["autoscale"])
    # the request-level model (``--fluid``, what the day-long study runs) on the same workload
    fluid_pairs, fluid_agree = agreement(fluid_run(sim_flags)["autoscale"])
    lo, hi = (float(x) for x in args.steady.split(":"))
    tl = auto["timeline"]
    steady_changes = sum(1 for a, b in itertools.pairwise(tl) if lo <= b[0] <= hi and a[1:] != b[1:])
    auto_step = to_target(auto, args.step_at)
    result: dict[str, Any] = {
        "workload": f"Azure conversation trace, {args.rate} req/s x curve {args.curve}, {args.duration:g} s",
        "slo": f"ttft:{args.ttft_ms:g} tpot:{args.tpot_ms:g} at 90 %",
        "profile": args.profile,
        "spend": args.spend,
        "live_autoscaled_attainment": round(auto["attainment"], 4),
        "live_autoscaled_failed": auto["failed"],
        "live_autoscaled_errors": auto["errors"],
        "live_autoscaled_worker_seconds": round(auto["worker_seconds"], 1),
        "live_autoscaled_moved": auto["moved"],
        "live_autoscaled_host_cpu_pct": [auto["host_cpu_median_pct"], auto["host_cpu_p90_pct"]],
        "step_to_target_s": auto_step["by_end"],
        "step_to_target_by_arrival_s": auto_step["by_arrival"],
        "changes_per_5_intervals": round(5 * steady_changes / ((hi - lo) / args.interval), 2),
        "sim_agreement": round(sum(agree) / len(agree), 3) if agree else None,
        "sim_layouts_at_boundaries": [b for _, b in pairs],
        "fluid_agreement": round(sum(fluid_agree) / len(fluid_agree), 3) if fluid_agree else None,
        "fluid_layouts_at_boundaries": [b for _, b in fluid_pairs],
        "live_layouts_at_boundaries": [a for a, _ in pairs],
        "live_windows": auto["windows"],
        "live_arrival_windows": auto["arrival_windows"],
        "live_arrival_misses": auto["arrival_misses"],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if static is not None:
        static_step = to_target(static, args.step_at)
        result.update({
            "best_static": args.static,
            "live_static_attainment": round(static["attainment"], 4),
            "live_static_failed": static["failed"],
            "live_static_errors": static["errors"],
            "live_static_worker_seconds": round(static["worker_seconds"], 1),
            "live_static_host_cpu_pct": [static["host_cpu_median_pct"], static["host_cpu_p90_pct"]],
            "live_static_step_to_target_s": static_step["by_end"],
            "live_static_step_to_target_by_arrival_s": static_step["by_arrival"],
            "live_static_windows": static["windows"],
            "live_static_arrival_windows": static["arrival_windows"],
            "live_static_arrival_misses": static["arrival_misses"],
            "attainment_gap_pp": round(100 * (static["attainment"] - auto["attainment"]), 2),
            "worker_seconds_ratio": round(auto["worker_seconds"] / static["worker_seconds"], 3),
        })  # fmt: skip
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
