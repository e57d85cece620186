"""Goodput of N router replicas against one router, on the simulated cluster (issue 59), and
the size of the load frames every worker sends each replica.

``pdserve simulate --routers N``: each request lands on one of N replicas at random, each
replica its own goodput dispatcher (ledger, prefix index, predictor corrections) that learns of
the others' work only from the workers' load reports (``WorkerLoad.others``, refreshed at each
of the worker's step ends). Defaults: the 64-GPU routing rows of BENCHMARKS.md — 4P+60D,
decode chunk budget 4,096, the Azure conversation trace, 30 s of arrivals a point, TTFT 250 ms
/ TPOT 100 ms, no admission. For every router count and every rate of ``--rates`` (req/s per
GPU) it runs one point; a router count's goodput is its highest passing rate (attainment >= 0.9)
below its first failing one, and ``crossing`` is where the straight line through those two
points' attainments meets 0.9 (a finer estimate than the rates' step). Two ablations, for
each router count above 1: ``--blind``, the replicas hearing nothing of each other (``others``
always zero); ``--on-command``, each worker reporting to every replica as soon as a command
changes what it holds (not only at its step ends: what a replica's view loses to staleness).

    python -m benchmarks.router_replicas --routers 1,4 --rates 20,20.5,21          # ~6 min a point on 2 cores
    python -m benchmarks.router_replicas --gpus 1000 --prefill 62 --duration 2 --rates 20 --routers 1,4

Frames: a worker sends every connection (the pool owner and each replica) one frame per step
and one every 0.5 s when idle, its load in each; the bytes of such a frame without deltas (a
heartbeat, or the frame of a replica none of whose requests had a token that step), of one
more one-token delta, and the CPU to encode and decode one, measured with the codec here.
Final line: JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pdserve.planning.simulate import add_simulate_args, simulate
from pdserve.simulator.replicas import WorkerReports
from pdserve.simulator.sim_worker import SimWorker
from pdserve.worker.codec import LENGTH, decode_batch, encode_batch
from pdserve.worker.commands import Answer, Command
from pdserve.worker.messages import (
    OutputBatch,
    PlacedWork,
    TokenDelta,
    TransferCounters,
    WorkerLoad,
    WorkerRole,
)

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/AzureLLMInferenceTrace_conv_2023.csv"
TARGET = 0.9


def flags(args: argparse.Namespace, routers: int, rate: float) -> list[str]:
    gpus = args.gpus
    return [
        "--trace", str(args.trace), "--duration", str(args.duration), "--goodput", "ttft:250", "tpot:100",
        "--prefill", str(args.prefill), "--decode", str(gpus - args.prefill), "--policy", "goodput",
        "--decode-max-num-batched-tokens", "4096", "--request-rate", str(rate * gpus),
        "--routers", str(routers), "--seed", str(args.seed),
    ]  # fmt: skip


def _heard_nothing(self: WorkerReports, now: float, undelivered: int = 0) -> None:
    """The ablation's report: each replica hears nothing of the others' work."""
    self.at = now
    self.heard = [PlacedWork()] * self.routers


_execute = SimWorker.execute


def _execute_and_report(self: SimWorker, cmd: Command, owner: int = 0) -> Answer | Future[Answer]:
    """The ablation's worker: it reports as soon as it ran a command."""
    answer = _execute(self, cmd, owner)
    self._report()
    return answer


def point(job: tuple[list[str], str]) -> dict[str, Any]:
    argv, ablation = job
    # (each point runs in a process of its own: a patch dies with it)
    if ablation == "blind":
        WorkerReports.report = _heard_nothing  # type: ignore[method-assign]
    elif ablation == "on-command":
        SimWorker.execute = _execute_and_report  # type: ignore[method-assign]
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    m = simulate(p.parse_args(argv))
    keep = ("slo_attainment", "p90_ttft_ms", "p90_tpot_ms", "completed", "num_prompts", "decisions",
            "simulation_wall_s", "offered_load_vs_bound")  # fmt: skip
    return {k: m[k] for k in keep}


def goodput(rows: dict[float, dict[str, Any]]) -> dict[str, Any]:
    """Highest passing rate below the first failing one, and the interpolated crossing."""
    rates = sorted(rows)
    passing, failing = None, None
    for r in rates:
        if rows[r]["slo_attainment"] >= TARGET:
            passing = r
        else:
            failing = r
            break
    crossing = None
    if passing is not None and failing is not None:
        a, b = rows[passing]["slo_attainment"], rows[failing]["slo_attainment"]
        crossing = passing + (failing - passing) * (a - TARGET) / (a - b)
    return {"passes": passing, "fails": failing, "crossing": crossing}


def frames() -> dict[str, Any]:
    """Bytes and codec CPU of a worker's load frame (no deltas), and of one one-token delta."""
    load = WorkerLoad(
        "decode-123", WorkerRole.DECODE, "10.1.2.3:45678", 180, 3, 65_000, 12_345, 40_000,
        transfers=TransferCounters(1234.5, 98_765, (("timeout", 3),), (("nccl", 12_345_678_901),)),
        busy_s=86_400.25, others=PlacedWork(3, 6_000, 140, 190_000, 28_000),
    )  # fmt: skip
    empty = encode_batch("decode-123", OutputBatch((), load))
    delta = TokenDelta("r-0123456789abcdef~1", (31_999,))
    one = encode_batch("decode-123", OutputBatch((delta,), load))
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        encode_batch("decode-123", OutputBatch((), load))
    enc = (time.perf_counter() - t0) / n
    body = empty[LENGTH.size :]
    t0 = time.perf_counter()
    for _ in range(n):
        decode_batch(body, "decode-123")
    dec = (time.perf_counter() - t0) / n
    return {"load_frame_bytes": len(empty), "one_token_delta_bytes": len(one) - len(empty),
            "encode_us": enc * 1e6, "decode_us": dec * 1e6}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers", default="1,4", help="router counts to compare, the first the baseline")
    p.add_argument("--rates", default="20,20.5,21", help="req/s per GPU, one point each")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--prefill", type=int, default=4, help="prefill workers (the rest decode)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals a point")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--seed", type=int, default=0, help="the workload's and the replica draw's seed")
    p.add_argument("--blind", action="store_true", help="also run the replicas blind to each other")
    p.add_argument("--on-command", action="store_true", help="also run workers reporting after every command")
    p.add_argument("--jobs", type=int, default=1, help="points run at once (processes)")
    args = p.parse_args()
    counts = [int(x) for x in args.routers.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    ablations = [a for a, on in (("blind", args.blind), ("on-command", args.on_command)) if on]
    runs = [(f"{n}", n, "") for n in counts]
    runs += [(f"{n}-{a}", n, a) for a in ablations for n in counts if n > 1]
    jobs = {(name, r): (flags(args, n, r), ablation) for name, n, ablation in runs for r in rates}
    layout = f"{args.prefill}P+{args.gpus - args.prefill}D"
    out: dict[str, Any] = {"gpus": args.gpus, "layout": layout, "duration_s": args.duration,
                           "rates_per_gpu": rates, "frames": frames()}  # fmt: skip
    results: dict[str, dict[float, dict[str, Any]]] = {name: {} for name, _, _ in runs}
    with ProcessPoolExecutor(args.jobs, max_tasks_per_child=1) as pool:  # (a blind patch stays in its own)
        done = {key: pool.submit(point, job) for key, job in jobs.items()}
        for (name, r), fut in done.items():
            results[name][r] = row = fut.result()
            print(f"routers {name} at {r:g} req/s/GPU: attainment {row['slo_attainment']:.3f} "
                  f"({row['simulation_wall_s']:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    base = goodput(results[runs[0][0]])
    for name, rows in results.items():
        g = goodput(rows)
        entry: dict[str, Any] = {"points": {str(r): v for r, v in sorted(rows.items())}, **g}
        if base["crossing"] and g["crossing"]:
            entry["crossing_vs_baseline"] = g["crossing"] / base["crossing"]
        out[f"routers_{name}"] = entry
    print(json.dumps(out))


if __name__ == "__main__":
    main()
