"""``pdserve simulate``: a layout judged on the event simulator (``pdserve.simulator.run``).

Each run is reported against the workload's work bound (``pdserve.planning.bound``: how far the
offered load is from what no layout sustains); with ``--autoscale`` the autoscaling planner
resizes the simulated pools while it runs (``pdserve.planning.sim_autoscale``), and with
``--fluid`` the request-level model (``pdserve.planning.fluid_run``) replaces the event
simulator for days at tens of GPUs.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from pdserve.bench.metrics import Slo
from pdserve.bench.runner import print_summary
from pdserve.bench.workload import RequestSpec
from pdserve.flags import pool_degrees, save_result
from pdserve.planning.bound import work_bound
from pdserve.planning.planner import Planner
from pdserve.planning.settings import add_autoscale, planner_settings
from pdserve.planning.sim_autoscale import AutoscaleConfig, SimAutoscaler
from pdserve.router.slo import Admission
from pdserve.simulator import run
from pdserve.simulator.run import Simulation, workload


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    run.add_simulate_args(p)
    add_autoscale(p)
    p.add_argument(
        "--fluid",
        action="store_true",
        help="the request-level model (pdserve.planning.fluid) instead of the engines step by "
        "step: a day at 64 GPUs in minutes; disaggregated layouts placed by least work (any "
        "--policy; goodput only with --no-local-prefill), --admission, no prefix caching",
    )
    p.add_argument("--fluid-tick", type=float, default=0.5, help="with --fluid: the decode tick (s)")
    p.add_argument(
        "--worker-start-s",
        type=float,
        default=20.0,
        help="with --autoscale: a new worker's start-up before it serves (it holds its GPU meanwhile)",
    )


def simulate(args: argparse.Namespace, specs: list[RequestSpec] | None = None) -> dict[str, Any]:
    sim = Simulation.build(args, specs)
    scaler = autoscaler(args, sim)
    m = sim.run()
    bound = work_bound(sim.profile, sim.submitted, args.block_size)
    shed = [sr.rejected for sr in sim.tracked]
    admitted = (
        work_bound(
            sim.profile, [s for s, no in zip(sim.submitted, shed, strict=True) if not no], args.block_size
        )
        if any(shed)
        else bound  # nothing shed: the same workload, no second pass over its prompts
    )
    gpus = sim.gpus
    finite = math.isfinite(args.request_rate)  # all at once: no load to speak of (None in the JSON)
    rate = args.request_rate if finite else 0.0
    m.update(
        {
            # no layout sustains more than this without shedding (planning/bound.py)
            "work_bound_rate_per_gpu": bound.rate_per_gpu,
            # offered (and admitted) work per second over the GPU-seconds available: above 1 the
            # backlog grows for as long as arrivals last, so a passing point is a transient
            "offered_load_vs_bound": rate / (gpus * bound.rate_per_gpu) if finite else None,
            "admitted_load_vs_bound": (
                rate * admitted.requests / max(1, bound.requests) / (gpus * admitted.rate_per_gpu)
                if finite and admitted.requests
                else (0.0 if finite else None)
            ),
        }
    )
    if scaler is not None:
        m["autoscale"] = scaler.summary(sim.end)
    return m


def autoscaler(args: argparse.Namespace, sim: Simulation) -> SimAutoscaler | None:
    if not getattr(args, "autoscale", False):
        return None
    if sim.colocated:
        raise ValueError("--autoscale resizes prefill and decode pools: not with --colocated")
    if sim.degrees[0] != sim.degrees[1]:
        raise ValueError("--autoscale moves workers between the pools: give both the same degree")
    slo = sim.slo
    if not (slo.ttft_ms and slo.tpot_ms):
        raise ValueError("--autoscale needs both targets: --goodput ttft:MS tpot:MS")
    refuses = getattr(args, "admission", "none") == Admission.REJECT.value
    planner = Planner(
        sim.profile,
        planner_settings(args, slo.ttft_ms / 1000, slo.tpot_ms / 1000, refuses, args.max_num_seqs),
    )
    config = AutoscaleConfig(args.autoscale_interval, args.worker_start_s)
    return SimAutoscaler(sim.cluster, planner, config, sim.tracked)


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        if args.fluid:
            if args.routers != 1:
                raise ValueError("--fluid models one router: run router replicas on the event simulator")
            if pool_degrees(args) != (1, 1):
                raise ValueError(
                    "--fluid counts workers, not GPUs: run it on workers of N GPUs with --profile NAME@tpN"
                )
            from pdserve.planning.fluid_run import print_fluid, simulate_fluid

            m = simulate_fluid(args, None if args.trace else workload(args), progress=True)
            print_fluid(m)
            save_result(args, m, f"simulate-fluid-{m['layout'].replace('+', '-')}.json")
            return 0
        m = simulate(args)
    except ValueError as e:
        print(f"pdserve simulate: error: {e}", file=sys.stderr)
        return 2
    print_summary(m, Slo.parse(args.goodput))
    print(f"simulated {m['num_prompts']} requests on {m['layout']} in {m['simulation_wall_s']:.1f}s")
    load, adm = m["offered_load_vs_bound"], m["admitted_load_vs_bound"]
    print(
        f"work bound: {m['work_bound_rate_per_gpu']:.2f} req/s per GPU without shedding"
        + (f" (offered load {load:.2f}x of it, admitted {adm:.2f}x)" if load is not None else "")
    )
    save_result(args, m, f"simulate-{m['layout'].replace(' ', '-').replace('+', '-')}.json")
    return 0
