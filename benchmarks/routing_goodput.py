"""Goodput of the routing policies, of conditional disaggregation and of SLO admission, in the
simulator (the router's real dispatchers and the runtime's real schedulers, H100 timing).

Three experiments, each a goodput bisection (joint TTFT/TPOT attainment >= 90 %, arrivals at
the trace's timestamps scaled to the mean rate, or Poisson for ShareGPT lengths) per
configuration. Each point runs ``max(--num-prompts, rate x --duration)`` requests: a fixed
count at a high rate is a burst that ends before the decode batches reach steady state (a
single decode worker then "serves" 36 req/s/GPU that it cannot sustain), so every point covers
``--duration`` seconds of arrivals, several request lifetimes.

* ``policies``: ``goodput`` vs ``least_loaded`` vs ``round_robin`` on static splits of
  ``--gpus`` GPUs, Azure conversation trace and ShareGPT lengths, TTFT 250 ms / TPOT 100 ms;
* ``conditional``: at TPOT 20, 50 and 100 ms (TTFT 250 ms), the best chunked colocated layout,
  the best static split (least-loaded, no local prefill) and the best split under the
  ``goodput`` policy with conditional disaggregation, on the same GPUs;
* ``overload``: twice the goodput rate of a layout, with and without ``--admission reject``:
  attainment over all requests, over admitted requests, and the share rejected.

    .venv/bin/python -m benchmarks.routing_goodput --experiment all      # minutes on 2 cores

The ceiling measured in the same run is each configuration's attainment at its lowest rate.
Final line: JSON with every result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.bench.sweep import sweep
from pdserve.planning.simulate import add_simulate_args, simulate

DATA = Path(__file__).resolve().parents[2] / "shared/data/traces"
DATASETS = {
    "azure-conv": ["--trace", str(DATA / "AzureLLMInferenceTrace_conv_2023.csv")],
    "sharegpt": ["--sharegpt", str(DATA / "sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv")],
}
COLOCATED_BUDGETS = (512, 2048, 4096, 8192)


def parse(flags: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    return p.parse_args(flags)


POINT = {"duration_s": 20.0, "min_prompts": 400}


def point(flags: list[str], rate: float, seed: int) -> dict[str, Any]:
    n = max(int(POINT["min_prompts"]), round(rate * POINT["duration_s"]))
    return simulate(
        parse([*flags, "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed)])
    )


def goodput(flags: list[str], gpus: int, args: argparse.Namespace) -> dict[str, Any]:
    async def one(rate: float, seed: int) -> dict[str, Any]:
        return point(flags, rate, seed)

    sw = argparse.Namespace(
        sweep_target=0.9, sweep_min_rate=args.min_rate_per_gpu * gpus, sweep_max_doublings=12,
        sweep_steps=args.steps, sweep_seeds=args.seeds, seed=0,
    )  # fmt: skip
    t0 = time.perf_counter()
    res = asyncio.run(sweep(one, sw))
    lowest = min(res["points"], key=lambda r: r["rate"])
    out = {
        "goodput": res["goodput_rate"],
        "per_gpu": res["goodput_rate"] / gpus,
        "bracketed": res["bracketed"],
        "ceiling_attainment": lowest["slo_attainment"],
        "wall_s": time.perf_counter() - t0,
    }
    print(f"    {' '.join(flags[-12:])}: {out['per_gpu']:.2f} req/s/GPU", file=sys.stderr, flush=True)
    return out


def splits(gpus: int, count: int) -> list[int]:
    """``count`` prefill-worker counts spread evenly over 1..gpus-1."""
    if gpus < 2:
        return []
    count = min(count, gpus - 1)
    return sorted({round(1 + i * (gpus - 2) / max(1, count - 1)) for i in range(count)})


def base(dataset: str, args: argparse.Namespace, ttft: int, tpot: int) -> list[str]:
    return [*DATASETS[dataset], "--goodput", f"ttft:{ttft}", f"tpot:{tpot}"]


POLICY_FLAGS = {
    "goodput": ["--policy", "goodput"],
    "goodput-no-local": ["--policy", "goodput", "--no-local-prefill"],  # routing alone
    "least_loaded": ["--policy", "least_loaded"],
    "round_robin": ["--policy", "round_robin"],
}


def exp_policies(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    policies = args.policies.split(",")
    for dataset in args.datasets.split(","):
        counts = [int(x) for x in args.prefill_counts.split(",")] if args.prefill_counts else None
        for p in counts or splits(args.gpus, args.policy_splits):
            layout = ["--prefill", str(p), "--decode", str(args.gpus - p), "--max-num-batched-tokens", "8192"]
            for policy in policies:
                flags = [*base(dataset, args, 250, 100), *layout, *POLICY_FLAGS[policy]]
                out[f"{dataset}/{p}P+{args.gpus - p}D/{policy}"] = goodput(flags, args.gpus, args)
        rows = {
            k: v
            for k, v in out.items()
            if k.startswith(f"{dataset}/") and isinstance(v, dict) and "per_gpu" in v
        }
        best = {pol: max(v["per_gpu"] for k, v in rows.items() if k.endswith(f"/{pol}")) for pol in policies}
        out[f"{dataset}/best_per_gpu"] = best
        baselines = [best[p] for p in ("least_loaded", "round_robin") if p in best]
        if "goodput" in best and baselines:
            out[f"{dataset}/goodput_over_best_baseline"] = best["goodput"] / max(baselines)
    return out


def exp_conditional(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dataset = "azure-conv"
    for tpot in (20, 50, 100):
        common = base(dataset, args, 250, tpot)
        coloc = {b: goodput([*common, "--colocated", str(args.gpus), "--max-num-batched-tokens", str(b)],
                            args.gpus, args)["per_gpu"] for b in COLOCATED_BUDGETS}  # fmt: skip
        static: dict[int, float] = {}
        conditional: dict[int, float] = {}
        counts = [int(x) for x in args.split_counts.split(",")] if args.split_counts else None
        # Decode workers prefill locally in chunks of the colocated layouts' tuned budget.
        tuned = max(coloc, key=lambda b: coloc[b])
        for p in counts or splits(args.gpus, args.splits):
            layout = ["--prefill", str(p), "--decode", str(args.gpus - p), "--max-num-batched-tokens", "8192"]
            static[p] = goodput([*common, *layout, "--policy", "least_loaded"], args.gpus, args)["per_gpu"]
            local = ["--policy", "goodput", "--decode-max-num-batched-tokens", str(tuned)]
            conditional[p] = goodput([*common, *layout, *local], args.gpus, args)["per_gpu"]
        best_c, best_s, best_g = max(coloc.values()), max(static.values()), max(conditional.values())
        out[f"tpot{tpot}"] = {
            "colocated_by_budget": coloc,
            "decode_local_budget": tuned,
            "static_by_prefill": static,
            "conditional_by_prefill": conditional,
            "best_colocated": best_c,
            "best_static": best_s,
            "best_conditional": best_g,
            "conditional_over_better": best_g / max(best_c, best_s),
        }
    return out


def exp_overload(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dataset in args.datasets.split(","):
        p = args.overload_prefill
        layout = ["--prefill", str(p), "--decode", str(args.gpus - p), "--max-num-batched-tokens", "8192"]
        common = [*base(dataset, args, 250, 100), *layout, "--policy", "goodput"]
        rate = 2 * goodput(common, args.gpus, args)["goodput"]
        row: dict[str, Any] = {"rate": rate}
        for admission in ("none", "reject"):
            m = point([*common, "--admission", admission], rate, 0)  # the same requests both times
            rejected = sum(n for k, n in m["decisions"].items() if k.startswith("rejected"))
            served = m["completed"]
            good = m["slo_attainment"] * m["num_prompts"]
            row[admission] = {
                "attainment_all": m["slo_attainment"],
                "attainment_admitted": good / served if served else 0.0,
                "rejected_share": rejected / m["num_prompts"],
                "goodput_rps": m["request_goodput"],
                "p99_ttft_ms": m["p99_ttft_ms"],
                "p99_tpot_ms": m["p99_tpot_ms"],
            }
        out[dataset] = row
    return out


EXPERIMENTS = {"policies": exp_policies, "conditional": exp_conditional, "overload": exp_overload}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiment", choices=[*EXPERIMENTS, "all"], default="all")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--splits", type=int, default=7, help="prefill:decode splits tried (conditional)")
    p.add_argument("--policy-splits", type=int, default=3, help="prefill:decode splits tried (policies)")
    p.add_argument("--prefill-counts", default="", help="policies: these prefill-worker counts instead")
    p.add_argument("--split-counts", default="", help="conditional: these prefill-worker counts instead")
    p.add_argument("--num-prompts", type=int, default=400, help="requests per point at least")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per point")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="bisection steps")
    p.add_argument("--min-rate-per-gpu", type=float, default=8.0, help="first rate of each sweep")
    p.add_argument("--overload-prefill", type=int, default=2)
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument(
        "--policies", default="goodput,least_loaded,round_robin", help=f"of {', '.join(POLICY_FLAGS)}"
    )
    args = p.parse_args()
    POINT.update(duration_s=args.duration, min_prompts=args.num_prompts)
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    results = {
        "gpus": args.gpus,
        "min_prompts": args.num_prompts,
        "duration_s": args.duration,
        "seeds": args.seeds,
    }
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        results[name] = EXPERIMENTS[name](args)
        print(json.dumps({name: results[name]}, indent=1), file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
