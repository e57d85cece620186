"""Goodput of emulated GPU clusters: the whole service runs (router, Ray actors, gRPC, block
accounting, KV transfers), only the model math is replaced by the H100 latency model's sleeps.

For each layout on 8 emulated H100s (Llama-3.1-8B profile): start ``pdserve serve --compute
emulated:h100-llama3-8b``, then ``pdserve bench --sweep`` replays the Azure conversation trace's
arrival pattern at bisected mean rates (the trace's own lengths, ``--num-prompts`` per point) and
finds the highest rate with >= 90 % joint TTFT/TPOT attainment.

    .venv/bin/python -m benchmarks.emulated_cluster        # ~15 minutes on 2 cores
    .venv/bin/python -m benchmarks.emulated_cluster --layouts 4p4d --policies goodput,least_loaded,round_robin
    .venv/bin/python -m benchmarks.emulated_cluster --profile h100-llama3-70b --layouts 1p8t12d2t

The ceiling in the same run: each layout's attainment at the lowest rate (an unloaded cluster).
Limits: router, workers' Python and client share this VM's 2 cores, which cap the serving path
at ~20k streamed tokens/s (``benchmarks/serving_overhead.py``); rates whose output tokens/s
approach that measure the host, not the emulated GPUs, so the sweep reports tokens/s per point.
``--time-scale K`` (with ``--rates``) runs the emulated GPUs K times slower
(``emulated:h100-llama3-8b@xK``) at 1/K of each rate with K-times SLOs and arrivals stretched
K-fold, and reports rates and latencies in GPU time: the host's share shrinks K-fold (see
``steptime/dilation.py``). The router gets the SLO as its default class either way.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.client import start_pdserve
from benchmarks.common import emit

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/AzureLLMInferenceTrace_conv_2023.csv"
# ``pdserve plan``'s 70B recommendation on 64 GPUs (2P@tp8+24D@tp2), at half scale.
_PLAN_70B = ["--prefill", "1", "--prefill-tp", "8", "--decode", "12", "--decode-tp", "2"]
LAYOUTS = {
    "2p6d": ["--prefill", "2", "--decode", "6", "--max-num-batched-tokens", "8192"],
    "4p4d": ["--prefill", "4", "--decode", "4", "--max-num-batched-tokens", "8192"],
    "6p2d": ["--prefill", "6", "--decode", "2", "--max-num-batched-tokens", "8192"],
    "8coloc": ["--colocated", "8", "--max-num-batched-tokens", "2048"],
    "1p8t12d2t": [*_PLAN_70B, "--max-num-batched-tokens", "2048"],  # --profile h100-llama3-70b
}


def gpus_of(flags: list[str]) -> int:
    """The GPUs a layout's workers span (each worker its pool's degree)."""

    def value(flag: str, default: int) -> int:
        return int(flags[flags.index(flag) + 1]) if flag in flags else default

    if "--colocated" in flags:
        return value("--colocated", 0) * value("--decode-tp", 1)
    return value("--prefill", 0) * value("--prefill-tp", 1) + value("--decode", 0) * value("--decode-tp", 1)


def simulate_layout(name: str, policy: str, rate: float, args: argparse.Namespace) -> dict[str, float]:
    """The simulator on the same layout, trace, requests and rate (no processes, virtual time)."""
    from pdserve.planning.simulate import add_simulate_args, simulate

    p = argparse.ArgumentParser()
    add_simulate_args(p)
    flags = LAYOUTS[name]
    budget = flags[flags.index("--max-num-batched-tokens") + 1]
    layout = flags[: flags.index("--max-num-batched-tokens")]
    ns = p.parse_args(
        [*layout, "--trace", str(args.trace), "--num-prompts", str(args.num_prompts),
         "--request-rate", str(rate), "--max-num-batched-tokens", budget, "--goodput", *args.goodput,
         "--duration", str(args.duration), "--profile", args.profile,
         "--policy", policy]
    )  # fmt: skip
    return simulate(ns)


def simulated_side_by_side(
    name: str, policy: str, points: list[dict[str, float]], args: argparse.Namespace
) -> dict[str, object]:
    rows: list[dict[str, Any]] = []
    for pt in sorted(points, key=lambda r: r["rate"]):
        sim = simulate_layout(name, policy, pt["rate"], args)
        rows.append(
            {
                "rate": pt["rate"],
                "attainment": [round(pt["slo_attainment"], 3), round(sim["slo_attainment"], 3)],
                "median_ttft_ms": [round(pt["median_ttft_ms"], 1), round(sim["median_ttft_ms"], 1)],
                "median_tpot_ms": [round(pt["median_tpot_ms"], 2), round(sim["median_tpot_ms"], 2)],
            }
        )
    sim_goodput = max((r["rate"] for r in rows if r["attainment"][1] >= 0.9), default=0.0)
    key = name if policy == "least_loaded" else f"{name}_{policy}"
    return {f"{key}_emulated_vs_simulated": rows, f"{key}_sim_goodput_rps_at_measured_rates": sim_goodput}


def fixed_rates(
    key: str, name: str, policy: str, port: str, exe: str, tmp: Path, args: argparse.Namespace
) -> dict[str, object]:
    """Attainment at the given rates (no sweep), each point ``--duration`` seconds of arrivals,
    next to the simulator on the same requests."""
    rows = []
    k = args.time_scale
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        fname = f"{key}_{rate:g}.json"
        # Each point its own prompts: a replay of the previous point's would hit the prefix
        # cache it filled on this same server (measured: TTFT below the prefill time).
        cmd = [exe, "bench", "--backend", "pdserve-grpc", "--port", port, "--dataset-name", "trace",
               "--dataset-path", str(args.trace), "--num-prompts", str(args.num_prompts), "--duration",
               str(args.duration * k), "--request-rate", str(rate / k),
               "--goodput", *scaled_slo(args.goodput, k), "--save-result", "--result-dir", str(tmp),
               "--result-filename", fname, "--disable-tqdm", "--seed", str(i)]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        m = json.loads((tmp / fname).read_text())
        sim = simulate_layout(name, policy, rate, args)
        rows.append({
            "rate": rate,
            "attainment": [round(m["slo_attainment"], 3), round(sim["slo_attainment"], 3)],
            "median_ttft_ms": [round(m["median_ttft_ms"] / k, 1), round(sim["median_ttft_ms"], 1)],
            "median_tpot_ms": [round(m["median_tpot_ms"] / k, 2), round(sim["median_tpot_ms"], 2)],
            "output_tokens_per_s_host": round(m["output_throughput"]),
        })  # fmt: skip
        print(f"  {key} {rate:g} req/s: emulated / simulated {rows[-1]}", file=sys.stderr, flush=True)
    return {f"{key}_fixed_rates": rows}


def scaled_slo(goodput: list[str], k: float) -> list[str]:
    """``["ttft:250", "tpot:100"]`` with every target multiplied by ``k``."""
    return [f"{name}:{float(ms) * k:g}" for name, _, ms in (g.partition(":") for g in goodput)]


def router_slo(goodput: list[str], k: float) -> str:
    """The bench's SLO as the router's default class, so its policy aims at the measured target."""
    targets = dict(g.split(":") for g in scaled_slo(goodput, k))
    return "default:" + ",".join(f"{n}={targets[n]}" for n in ("ttft", "tpot") if n in targets)


def run_layout(name: str, policy: str, exe: str, tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    k = args.time_scale if args.rates else 1.0
    profile = args.profile if k == 1.0 else f"{args.profile}@x{k:g}"
    serve = ["--model", "tiny", "--compute", f"emulated:{profile}", "--max-num-seqs", "256",
             "--policy", policy, "--slo", router_slo(args.goodput, k), *LAYOUTS[name]]  # fmt: skip
    print(f"{name}: pdserve serve {' '.join(serve)}", file=sys.stderr, flush=True)
    key = name if policy == "least_loaded" else f"{name}_{policy}"
    server = start_pdserve(*serve)
    if args.rates:
        try:
            return fixed_rates(key, name, policy, server.grpc.rsplit(":", 1)[1], exe, tmp, args)
        finally:
            server.stop()
    try:
        port = server.grpc.rsplit(":", 1)[1]
        cmd = [exe, "bench", "--backend", "pdserve-grpc", "--port", port, "--dataset-name", "trace",
               "--dataset-path", str(args.trace), "--num-prompts", str(args.num_prompts), "--sweep",
               "--duration", str(args.duration),
               "--goodput", *args.goodput, "--sweep-min-rate", str(args.min_rate), "--sweep-seeds", "1",
               "--sweep-steps", str(args.steps), "--result-dir", str(tmp), "--result-filename",
               f"{key}.json"]  # fmt: skip
        subprocess.run(cmd, check=True)
    finally:
        server.stop()
    res = json.loads((tmp / f"{key}.json").read_text())
    out: dict[str, object] = {
        f"{key}_goodput_rps": round(res["goodput_rate"], 2),
        f"{key}_goodput_rps_per_gpu": round(res["goodput_rate"] / gpus_of(LAYOUTS[name]), 3),
        f"{key}_bracketed": res["bracketed"],
    }
    keep = ("rate", "slo_attainment", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    out[f"{key}_points"] = [{k: round(pt[k], 3) for k in keep} for pt in res["points"]]
    out.update(simulated_side_by_side(name, policy, res["points"], args))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="4p4d,6p2d,8coloc")
    p.add_argument("--policies", default="least_loaded", help="routing policies, comma-separated")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--duration", type=float, default=0.0, help="seconds of arrivals per point at least")
    p.add_argument(
        "--rates", default="", help="measure these rates (req/s, comma-separated) instead of a sweep"
    )
    p.add_argument("--goodput", nargs="+", default=["ttft:250", "tpot:100"])
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="with --rates: GPUs K times slower (time dilation)"
    )
    p.add_argument("--min-rate", type=float, default=8.0)
    p.add_argument("--profile", default="h100-llama3-8b", help="the emulated GPUs' step-time model")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    if not args.trace.exists():
        sys.exit(f"trace not found: {args.trace}")
    exe = str(Path(sys.executable).with_name("pdserve"))
    out: dict[str, object] = {"trace": args.trace.name, "goodput_slo": " ".join(args.goodput)}
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-emulated-"))
    for name in args.layouts.split(","):
        for policy in args.policies.split(","):
            out.update(run_layout(name, policy, exe, tmp, args))
    print(f"plots and results in {tmp}", file=sys.stderr)
    emit(out)


if __name__ == "__main__":
    main()
