"""Prefix-aware routing on the simulated cluster: how much of the prompts the prefix caches
serve, and what that does to TTFT, under the goodput policy.

The simulator runs the real engines (their real block pools) and the router's real policy, so
what the policy believes each worker caches — and hence where it sends a prompt — is exactly
what the service would believe. Two workloads:

- ``conversations``: the long-prompt multi-turn trace (``benchmarks.long_prompt_trace``: every
  prompt starts with a shared system prompt, and a conversation's next turn extends its last);
- ``fanout``: groups of prompts sharing a long prefix that arrive together (an agent fanning
  out, several samples of one prompt), within less than one prefill of each other: the case a
  router only learning from the workers' events sees no holder for until the first prefill
  has run.

``--hint-s`` runs each workload once per value: the seconds a router counts the keys of a
prompt it just placed as cached on its worker before that worker reports them (0: the
workers' events alone).

    python -m benchmarks.prefix_routing                                        # seconds
    python -m benchmarks.prefix_routing --layout 40x24 --rows 4000 --rate 150 --groups 100 --group-rate 10

The same script on the code before the index learnt from events (where ``--hint-s`` changes
nothing) gives the numbers of a router that guessed from its own placements.

Final JSON line: per workload and hint, the share of prompt tokens served from a prefix cache
(``hit_share``), the mean and p90 TTFT (ms), SLO attainment, and the routing reasons taken.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.long_prompt_trace import generate
from pdserve.bench.workload import RequestSpec
from pdserve.simulator.run import Simulation, add_simulate_args

GOODPUT = ["ttft:2000", "tpot:100"]  # the long-prompt trace's targets in BENCHMARKS.md


def fanout(groups: int, size: int, prefix: int, own: int, rate: float, seed: int) -> list[RequestSpec]:
    """``groups`` groups (Poisson at ``rate``) of ``size`` prompts: a ``prefix``-token prefix of
    their group, then ``own`` tokens of their own, all within 20 ms of the group's start."""
    rng = random.Random(seed)
    specs = []
    t = 0.0
    for _ in range(groups):
        t += rng.expovariate(rate)
        head = tuple(rng.randrange(32000) for _ in range(prefix))
        for _ in range(size):
            prompt = head + tuple(rng.randrange(32000) for _ in range(own))
            specs.append(RequestSpec(t + rng.uniform(0.0, 0.02), prompt, len(prompt), 128))
    specs.sort(key=lambda s: s.arrival_s)
    return specs


def run(argv: list[str], hint_s: float, specs: list[RequestSpec] | None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    args = p.parse_args([*argv, "--policy", "goodput", "--goodput", *GOODPUT])
    sim = Simulation.build(args, specs)
    prefix = getattr(sim.cluster.dispatcher, "prefix", None)
    if prefix is not None:
        prefix.hint_s = hint_s
    m = sim.run()
    done = [sr for sr in sim.tracked if sr.token_times]
    prompt = sum(sr.num_prompt_tokens for sr in done)
    ttfts = sorted(1000 * (sr.token_times[0] - sr.arrival) for sr in done)
    return {
        "hit_share": round(sum(sr.cached for sr in done) / max(1, prompt), 4),
        "mean_ttft_ms": round(statistics.fmean(ttfts), 1) if ttfts else None,
        "p90_ttft_ms": round(ttfts[int(0.9 * (len(ttfts) - 1))], 1) if ttfts else None,
        "slo_attainment": m.get("slo_attainment"),
        "finished": len(done),
        "decisions": m.get("decisions"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hint-s", default="0,2,10", help="hint lifetimes to compare, comma-separated")
    ap.add_argument("--layout", default="4x4", help="PxD")
    ap.add_argument("--rows", type=int, default=600, help="conversation turns replayed")
    ap.add_argument("--rate", type=float, default=3.0, help="conversation turns a second")
    ap.add_argument("--groups", type=int, default=60, help="fan-out groups")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--group-rate", type=float, default=1.0, help="fan-out groups a second")
    ap.add_argument(
        "--budget", type=int, default=2048, help="step token budget (the plan's pick for the trace)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    p, d = args.layout.split("x")
    layout = [
        "--prefill",
        p,
        "--decode",
        d,
        "--seed",
        str(args.seed),
        "--max-num-batched-tokens",
        str(args.budget),
    ]
    out: dict[str, Any] = {"layout": f"{p}P+{d}D"}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "conversations.jsonl"
        trace.write_text("".join(r.to_json() + "\n" for r in generate(args.rows, args.seed, 64)))
        conv = [*layout, "--trace", str(trace), "--num-prompts", str(args.rows),
                "--request-rate", str(args.rate)]  # fmt: skip
        burst = fanout(args.groups, args.group_size, 4096, 128, args.group_rate, args.seed)
        for hint in (float(h) for h in args.hint_s.split(",")):
            for name, argv, specs in (("conversations", conv, None), ("fanout", layout, burst)):
                r = run(argv, hint, specs)
                out.setdefault(name, {})[f"hint_{hint:g}s"] = r
                print(f"{name} hint {hint:g} s: {json.dumps(r, sort_keys=True)}", flush=True)
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
