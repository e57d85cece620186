"""``pdserve plan``: which layout of N GPUs serves a workload with the most goodput per GPU.

Candidates: colocated engines with a few chunked-prefill budgets, and every prefill:decode split
(a stride of them on large clusters) with a few prefill budgets. Each candidate's goodput comes
from the simulator (``simulator.run.simulate``) and the same bisection ``pdserve bench --sweep``
uses. Colocated layouts are candidates like any other, so the answer may be "do not split".
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from typing import Any

from pdserve.bench.metrics import Slo
from pdserve.bench.sweep import sweep
from simulator.run import add_simulate_args, simulate

COLOCATED_BUDGETS = (512, 2048, 8192)
PREFILL_BUDGETS = (2048, 8192)


@dataclass(frozen=True)
class Candidate:
    prefill: int
    decode: int
    colocated: int
    budget: int  # tokens per step: the colocated chunk budget, or the prefill workers' budget

    @property
    def gpus(self) -> int:
        return self.colocated or self.prefill + self.decode

    @property
    def label(self) -> str:
        shape = f"{self.colocated} colocated" if self.colocated else f"{self.prefill}P+{self.decode}D"
        return f"{shape}, budget {self.budget}"

    def serve_flags(self, profile: str) -> str:
        shape = (
            f"--colocated {self.colocated}"
            if self.colocated
            else f"--prefill {self.prefill} --decode {self.decode}"
        )
        return f"pdserve serve {shape} --max-num-batched-tokens {self.budget}  # profile {profile}"


def candidates(gpus: int, max_splits: int = 16) -> list[Candidate]:
    out = [Candidate(0, 0, gpus, b) for b in COLOCATED_BUDGETS]
    if gpus >= 2:
        stride = max(1, (gpus - 1) // max_splits)
        for p in range(1, gpus, stride):
            out += [Candidate(p, gpus - p, 0, b) for b in PREFILL_BUDGETS]
    return out


def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_simulate_args(p)
    p.add_argument("--gpus", type=int, required=True, help="GPUs (workers) to lay out")
    p.add_argument("--max-splits", type=int, default=16, help="prefill:decode splits tried at most")
    p.add_argument("--sweep-steps", type=int, default=5)


async def goodput(c: Candidate, args: argparse.Namespace) -> dict[str, Any]:
    async def point(rate: float, seed: int) -> dict[str, Any]:
        ns = argparse.Namespace(**{**vars(args), "prefill": c.prefill, "decode": c.decode,
                                   "colocated": c.colocated, "max_num_batched_tokens": c.budget,
                                   "request_rate": rate, "seed": seed})  # fmt: skip
        return simulate(ns)

    sw = argparse.Namespace(
        sweep_target=0.9, sweep_min_rate=float(c.gpus), sweep_max_doublings=12, sweep_steps=args.sweep_steps,
        sweep_seeds=1, seed=args.seed,
    )  # fmt: skip
    return await sweep(point, sw)


def cmd_plan(args: argparse.Namespace) -> int:
    if Slo.parse(args.goodput).empty:
        print("pdserve plan: error: --goodput ttft:MS tpot:MS is required", file=sys.stderr)
        return 2
    if args.gpus < 1:
        print("pdserve plan: error: --gpus must be >= 1", file=sys.stderr)
        return 2
    rows = []
    for c in candidates(args.gpus, args.max_splits):
        res = asyncio.run(goodput(c, args))
        per_gpu = res["goodput_rate"] / c.gpus
        rows.append((per_gpu, c, res))
        bound = "" if res["bracketed"] else " (>=)"
        print(
            f"  {c.label:<32} goodput {res['goodput_rate']:8.2f} req/s{bound}  {per_gpu:7.3f} per GPU",
            flush=True,
        )
    rows.sort(key=lambda r: -r[0])
    best_per_gpu, best, _ = rows[0]
    best_coloc = max((r for r in rows if r[1].colocated), key=lambda r: r[0])
    ratio = best_per_gpu / best_coloc[0] if best_coloc[0] else float("inf")
    print(f"\nrecommended: {best.label}: {best_per_gpu:.3f} req/s per GPU")
    print(f"  {ratio:.2f}x the best colocated layout ({best_coloc[1].label})")
    print(f"  {best.serve_flags(args.profile)}")
    return 0
