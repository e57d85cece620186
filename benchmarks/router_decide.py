"""The router's own CPU a request: one routing decision against pools of growing size.

The goodput policy prices candidate (prefill, decode) pairs with the step-time model for every
request; how that cost grows with the pools bounds how many requests one router core can place
at scale. The floor measured in the same run is ``least_loaded`` (a pick over the same worker
loads, no pricing) on the same pools.

Each layout holds a steady population of in-flight requests (``--inflight``: placed, then the
oldest finished as each new one is placed) so the ledgers, batches and prefix index are as full
as under load; prompts draw from the Azure conversation trace's lengths when it is present.

    .venv/bin/python -m benchmarks.router_decide                  # about a minute
    .venv/bin/python -m benchmarks.router_decide --layouts 2x2,8x8,24x40 --repeat 5

Final JSON line: per layout and policy, the median microseconds of one decision over
``--repeat`` rounds of ``--requests``, and the requests a second one core decides at that cost.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import emit
from pdserve.router.dispatchers import make_dispatcher
from pdserve.router.goodput import GoodputPolicy
from pdserve.router.policy import Dispatcher, RouteRequest
from pdserve.router.slo import SloClass
from pdserve.worker.messages import WorkerLoad, WorkerRole

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/AzureLLMInferenceTrace_conv_2023.csv"
CHAT = SloClass("chat", ttft_ms=250, tpot_ms=100)


def lengths() -> list[tuple[int, int]]:
    if not TRACE.exists():
        return [(1155, 211)]
    with TRACE.open() as f:
        rows = list(csv.reader(f))[1:]
    return [(int(r[1]), int(r[2])) for r in rows]


def worker(wid: str, role: WorkerRole) -> WorkerLoad:
    return WorkerLoad(wid, role, "", 0, 0, 100_000, 100_000, 0)


def measure(policy: str, prefill: int, decode: int, args: argparse.Namespace) -> float:
    """Median seconds of one decision at ``prefill`` x ``decode`` workers."""
    pol: Dispatcher = make_dispatcher(policy, block_size=16, local_prefill=True, prefill_step_tokens=8192)
    pre = [worker(f"p{i}", WorkerRole.PREFILL) for i in range(prefill)]
    dec = [worker(f"d{i}", WorkerRole.DECODE) for i in range(decode)]
    lens = itertools.cycle(lengths())
    n = 0

    def place(count: int) -> None:
        nonlocal n
        for _ in range(count):
            prompt, output = next(lens)
            now = n * 1e-3
            pol.decide(RouteRequest(prompt, output, request_id=f"r{n}", slo=CHAT), pre, dec, now=now)
            if n >= args.inflight and isinstance(pol, GoodputPolicy):
                old = f"r{n - args.inflight}"
                pol.on_first_token(old, now, 0.1)
                pol.on_end(old, now, 0.01)
            n += 1

    place(args.inflight)  # the steady population
    rounds: list[float] = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        place(args.requests)
        rounds.append((time.perf_counter() - t0) / args.requests)
    return statistics.median(rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="2x2,8x8,24x40", help="PxD pools, comma-separated")
    ap.add_argument("--requests", type=int, default=300, help="decisions a round")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--inflight", type=int, default=2000)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    for spec in args.layouts.split(","):
        p, d = (int(x) for x in spec.split("x"))
        row: dict[str, Any] = {}
        for policy in ("least_loaded", "goodput"):
            s = measure(policy, p, d, args)
            row[policy] = {"us_per_request": round(s * 1e6, 1), "requests_per_core_s": round(1 / s)}
            print(
                f"{p}P+{d}D {policy}: {s * 1e6:,.0f} us a decision ({1 / s:,.0f} a second a core)", flush=True
            )
        row["goodput_over_floor"] = round(
            row["goodput"]["us_per_request"] / row["least_loaded"]["us_per_request"], 1
        )
        out[f"{p}P+{d}D"] = row
    emit(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
