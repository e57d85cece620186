"""Prefill/decode interference on one machine: disaggregated 1 prefill + 1 decode (one core
each) against one colocated engine on both cores, same model (``bench``), same workload.

The workload mixes short and long prompts arriving as a Poisson process; every request streams
its tokens over gRPC and the client records each token's arrival. A colocated engine runs a
long prompt's prefill chunks in the same forward passes as the running decodes (chunked
prefill, Sarathi-style), so those decodes' inter-token latency jumps while the prefill lasts;
the disaggregated decode worker never runs a prefill, so its TPOT stays near its median (the
prefill worker's queue shows up in TTFT instead). DistServe's motivating experiment, on CPU.

The ceiling measured in the same run is each configuration alone: the median decode step
with no prefill traffic (an idle-machine TPOT floor), so spikes read as ratios to it.

    .venv/bin/python -m benchmarks.interference                 # ~4 minutes on 2 cores
    .venv/bin/python -m benchmarks.interference --requests 24   # quicker, noisier
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.client import Server, start_pdserve
from benchmarks.common import emit
from pdserve.bench.client import PdserveGrpcBackend
from pdserve.bench.metrics import RequestResult, Slo
from pdserve.bench.workload import RequestSpec

VOCAB = 32000


def workload(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt, max_tokens), deterministic for a seed."""
    rng = random.Random(args.seed)
    t = 0.0
    out = []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        n = args.long_prompt if rng.random() < args.long_fraction else args.short_prompt
        out.append((t, [rng.randrange(3, VOCAB) for _ in range(n)], args.output_len))
    return out


def spec(prompt: list[int], n: int, at: float = 0.0) -> RequestSpec:
    return RequestSpec(at, tuple(prompt), len(prompt), n)


async def drive(server: Server, work: list[tuple[float, list[int], int]]) -> list[RequestResult]:
    backend = PdserveGrpcBackend(server.grpc, None, temperature=0.0)
    try:
        await backend.send(spec([5, 6, 7], 4))  # warm-up
        t0 = time.perf_counter()

        async def one(at: float, prompt: list[int], n: int) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await backend.send(spec(prompt, n))

        return list(await asyncio.gather(*(one(*w) for w in work)))
    finally:
        await backend.close()


async def decode_floor(server: Server, output_len: int) -> float:
    """Median inter-token time of a lone request: the configuration's decode-step floor."""
    backend = PdserveGrpcBackend(server.grpc, None, temperature=0.0)
    try:
        r = await backend.send(spec(list(range(3, 131)), output_len))
    finally:
        await backend.close()
    return statistics.median(r.itls)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(runs: list[RequestResult], ttft_slo: float, tpot_slo: float, floor: float) -> dict[str, Any]:
    ok = [r for r in runs if r.success]
    slo = Slo(ttft_ms=ttft_slo, tpot_ms=tpot_slo)
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [(r.tpot or 0.0) * 1000 for r in ok]
    itl = [x * 1000 for r in ok for x in r.itls]
    met = sum(1 for r in ok if slo.met(r))
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(runs) - len(ok),
        "attainment": met / len(runs),
        "decode_floor_ms": floor * 1000,
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            out[f"{name}_ms_p{q}"] = round(pct(xs, q / 100), 2)
    out["tpot_p99_over_p50"] = round(out["tpot_ms_p99"] / out["tpot_ms_p50"], 2)
    out["itl_p99_over_floor"] = round(out["itl_ms_p99"] / (floor * 1000), 2)
    return out


def run_config(name: str, serve_args: list[str], args: argparse.Namespace) -> dict[str, Any]:
    print(f"{name}: starting pdserve {' '.join(serve_args)}", file=sys.stderr, flush=True)
    server = start_pdserve(*serve_args)
    try:
        floor = asyncio.run(decode_floor(server, args.output_len))
        t0 = time.perf_counter()
        runs = asyncio.run(drive(server, workload(args)))
        wall = time.perf_counter() - t0
    finally:
        server.stop()
    s = summarize(runs, args.ttft_slo, args.tpot_slo, floor)
    s["duration_s"] = round(wall, 1)
    print(f"{name}: {s}", file=sys.stderr, flush=True)
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.8, help="requests/s (Poisson)")
    p.add_argument("--short-prompt", type=int, default=128)
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--long-fraction", type=float, default=0.3)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-slo", type=float, default=2000.0, help="ms")
    p.add_argument("--tpot-slo", type=float, default=25.0, help="ms (tight: ~1.5x the decode floor)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="bench")
    args = p.parse_args()
    common = ["--model", args.model, "--max-num-batched-tokens", "512", "--kv-cache-mib", "512"]
    disagg = run_config(
        "disaggregated", [*common, "--prefill", "1", "--decode", "1", "--cpus-per-worker", "1"], args
    )
    coloc = run_config("colocated", [*common, "--colocated", "1", "--cpus-per-worker", "2"], args)
    result: dict[str, Any] = {
        "model": args.model,
        "requests": args.requests,
        "rate": args.rate,
        "ttft_slo_ms": args.ttft_slo,
        "tpot_slo_ms": args.tpot_slo,
    }
    for name, s in (("disagg", disagg), ("coloc", coloc)):
        for k, v in s.items():
            result[f"{name}_{k}"] = v
    emit(result)


if __name__ == "__main__":
    main()
