"""``pdserve simulate``: a workload through the simulated cluster, reported like ``pdserve bench``."""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import RequestResult, Slo, summarize
from pdserve.bench.runner import add_workload_args, build_workload, print_summary
from pdserve.bench.workload import RequestSpec
from pdserve.deploy.planner import Planner
from pdserve.flags import (
    add_autoscale,
    add_block_size,
    add_goodput,
    add_layout,
    add_policy,
    add_result,
    add_scheduler,
    colocated_count,
    planner_settings,
    save_result,
)
from pdserve.model_runtime.backend import GPU_MAX_SEQS, GPU_STEP_TOKENS
from pdserve.model_runtime.scheduler.plan import ColocatedSchedule, QueuePolicy, SchedulerConfig
from pdserve.router.config import RouterConfig
from pdserve.router.dispatchers import make_dispatcher
from pdserve.router.slo import Admission, SloClass
from pdserve.simulator.autoscale import AutoscaleConfig, SimAutoscaler
from pdserve.simulator.bound import work_bound
from pdserve.simulator.calibration import load_sim_profile
from pdserve.simulator.cluster import Cluster
from pdserve.simulator.early_stop import EarlyStop
from pdserve.simulator.prompt_memo import checked
from pdserve.simulator.sim_request import SimRequest
from pdserve.steptime.model import StepTimeModel


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=None, help="Azure CSV or JSONL trace (else random lengths)")
    p.add_argument(
        "--sharegpt", type=Path, default=None, help="ShareGPT-style lengths CSV, Poisson/gamma arrivals"
    )
    add_layout(p)
    p.add_argument("--profile", default="h100-llama3-8b", help="built-in name or JSON file")
    add_policy(p, "least_loaded")  # the static split; ``serve``'s goodput routing is --policy goodput
    p.add_argument(
        "--admission",
        choices=[a.value for a in Admission],
        default="none",
        help="goodput policy: what to do with a request predicted to miss the --goodput SLO",
    )
    p.add_argument(
        "--no-local-prefill",
        dest="local_prefill",
        action="store_false",
        help="goodput policy: never prefill on a decode worker (static disaggregation)",
    )
    add_workload_args(p)
    add_scheduler(p, max_num_batched_tokens=GPU_STEP_TOKENS, max_num_seqs=GPU_MAX_SEQS)  # an H100's
    p.add_argument(
        "--decode-max-num-batched-tokens",
        type=int,
        default=0,
        help="decode workers' step budget, which bounds their local prefill chunks (0: as above)",
    )
    add_block_size(p, 64, " (coarser than a GPU engine: 4x fewer blocks to track)")
    p.add_argument(
        "--shared-host",
        action="store_true",
        help="all workers share one host (CPU): steps slow down by the profile's co-activity factors",
    )
    p.add_argument(
        "--jitter-seed",
        type=int,
        default=0,
        help="seed of the step-time variability a profile measured (HostCalibration.*_jitter); "
        "other seeds show the spread of a run",
    )
    p.add_argument(
        "--reserve-timeout-s",
        type=float,
        default=RouterConfig.reserve_timeout_s,
        help="how long a request waits for KV room on its decode worker before it fails "
        "RESOURCE_EXHAUSTED (the router's deadline)",
    )
    p.add_argument(
        "--no-fast-steps",
        dest="fast_steps",
        action="store_false",
        help="step every engine through its own step(), decode-only steps too (the reference the "
        "fast path is checked against: the same run, slower)",
    )
    add_goodput(p)
    add_result(p)
    add_autoscale(p)
    p.add_argument(
        "--fluid",
        action="store_true",
        help="the request-level model (pdserve.simulator.fluid) instead of the engines step by "
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


def workload(args: argparse.Namespace) -> list[RequestSpec]:
    ns = argparse.Namespace(
        seed=args.seed,
        num_prompts=args.num_prompts,
        duration=args.duration,
        dataset_name="trace" if args.trace else ("sharegpt" if getattr(args, "sharegpt", None) else "random"),
        dataset_path=args.trace or getattr(args, "sharegpt", None),
        time_scale=args.time_scale,
        trace_start=getattr(args, "trace_start", 0),
        rate_curve=getattr(args, "rate_curve", None),
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        vocab_size=32000,
        block_size=args.block_size,
    )
    return build_workload(ns)


def simulate(args: argparse.Namespace, specs: list[RequestSpec] | None = None) -> dict[str, Any]:
    profile = load_sim_profile(args.profile)
    specs = specs if specs is not None else workload(args)
    schedule = ColocatedSchedule(getattr(args, "colocated_schedule", ColocatedSchedule.CHUNKED.value))
    cfg = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                          policy=QueuePolicy.PRIORITY, colocated=schedule)  # fmt: skip
    # Decode workers of a split prefill only locally (conditional disaggregation): their own,
    # usually smaller, chunk budget keeps those chunks from stalling the batch.
    decode_budget = getattr(args, "decode_max_num_batched_tokens", 0) or args.max_num_batched_tokens
    colocated = colocated_count(args)
    decode_cfg = cfg if colocated else replace(cfg, max_num_batched_tokens=decode_budget)
    slo = Slo.parse(args.goodput)
    admission = Admission(getattr(args, "admission", "none"))
    slo_class = SloClass("sim", (slo.ttft_ms or 0.0), (slo.tpot_ms or 0.0), admission)
    dispatcher = make_dispatcher(
        args.policy, profile, args.block_size, getattr(args, "local_prefill", True),
        local_step_tokens=decode_cfg.max_num_batched_tokens, prefill_step_tokens=cfg.max_num_batched_tokens,
    )  # fmt: skip
    cluster = Cluster(
        profile, args.prefill, args.decode, colocated, dispatcher, cfg, decode_cfg, args.block_size,
        slo_class, shared_host=getattr(args, "shared_host", False),
        jitter_seed=getattr(args, "jitter_seed", 0),
        reserve_timeout_s=getattr(args, "reserve_timeout_s", RouterConfig.reserve_timeout_s),
        fast_steps=getattr(args, "fast_steps", True),
    )  # fmt: skip
    capacity = min(w.kv.num_blocks for w in cluster.decoders) * args.block_size
    results: list[RequestResult] = []
    tracked = []
    submitted: list[RequestSpec] = []  # as the cluster sees them: the work bound's workload
    for i, s in enumerate(specs):
        prompt = checked(s.prompt if isinstance(s.prompt, tuple) else tuple(range(s.prompt_len)))
        if s.prompt_len + s.output_len > min(profile.max_model_len, capacity):
            results.append(RequestResult(s.prompt_len, error="INVALID_ARGUMENT: exceeds the context"))
            continue
        tracked.append(cluster.submit(s.arrival_s, f"r{i}", prompt, s.output_len))
        submitted.append(RequestSpec(s.arrival_s, prompt, s.prompt_len, s.output_len))
    scaler = autoscaler(args, profile, slo, colocated, cluster, tracked)
    stop_below = getattr(args, "stop_below", None)
    if stop_below is not None and specs and not slo.empty:
        cluster.early_stop = EarlyStop(
            slo, len(specs), stop_below, len(results), on_pass=getattr(args, "stop_on_pass", True)
        )
        cluster.watch_deadlines(tracked)
    t0 = time.perf_counter()
    with _no_gc():
        cluster.run()
    wall = time.perf_counter() - t0
    end = 0.0
    for sr in tracked:
        r = sr.result()
        results.append(r)
        if r.success:
            end = max(end, sr.token_times[-1])
    duration = end - min((s.arrival_s for s in specs), default=0.0)
    m = summarize(results, duration, Slo.parse(args.goodput))
    if cluster.early_stop is not None and cluster.early_stop.stopped:
        # The other metrics describe the requests finished by then; attainment is what the point
        # was known to reach on its side of the target (the most a failing one could still
        # reach, the least a passing one reaches).
        m["slo_attainment"] = cluster.early_stop.attainment_bound
        m["stopped_early"] = True
    bound = work_bound(profile, submitted, args.block_size)
    shed = [sr.rejected for sr in tracked]
    admitted = (
        work_bound(profile, [s for s, no in zip(submitted, shed, strict=True) if not no], args.block_size)
        if any(shed)
        else bound  # nothing shed: the same workload, no second pass over its prompts
    )
    gpus = colocated or args.prefill + args.decode
    finite = math.isfinite(args.request_rate)  # all at once: no load to speak of (None in the JSON)
    rate = args.request_rate if finite else 0.0
    m.update(
        {
            # no layout sustains more than this without shedding (simulator/bound.py)
            "work_bound_rate_per_gpu": bound.rate_per_gpu,
            # offered (and admitted) work per second over the GPU-seconds available: above 1 the
            # backlog grows for as long as arrivals last, so a passing point is a transient
            "offered_load_vs_bound": rate / (gpus * bound.rate_per_gpu) if finite else None,
            "admitted_load_vs_bound": (
                rate * admitted.requests / max(1, bound.requests) / (gpus * admitted.rate_per_gpu)
                if finite and admitted.requests
                else (0.0 if finite else None)
            ),
            "simulated": True,
            "profile": profile.name,
            "layout": f"{colocated} colocated" if colocated else f"{args.prefill}P+{args.decode}D",
            "policy": args.policy,
            "colocated_schedule": schedule.value,
            "admission": admission.value,
            "decisions": dict(sorted(cluster.decisions.items())),
            "num_prompts": len(specs),
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "simulation_wall_s": wall,
            # GPU-seconds held: every worker from its start to its stop (or the last token)
            "worker_seconds": cluster.worker_seconds(end),
        }
    )
    if scaler is not None:
        m["autoscale"] = scaler.summary(end)
    return m


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic collector paused: a run allocates millions of short-lived objects among a
    workload's millions of long-lived ones (long prompts' tuples, block keys), and each full
    collection walked them all again (a fifth of a long-prompt point's time). What the run
    leaves in cycles goes at the collector's next pass, after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def autoscaler(
    args: argparse.Namespace, profile: StepTimeModel, slo: Slo, colocated: int, cluster: Cluster,
    tracked: list[SimRequest],
) -> SimAutoscaler | None:  # fmt: skip
    if not getattr(args, "autoscale", False):
        return None
    if colocated:
        raise ValueError("--autoscale resizes prefill and decode pools: not with --colocated")
    if not (slo.ttft_ms and slo.tpot_ms):
        raise ValueError("--autoscale needs both targets: --goodput ttft:MS tpot:MS")
    refuses = getattr(args, "admission", "none") == Admission.REJECT.value
    planner = Planner(
        profile, planner_settings(args, slo.ttft_ms / 1000, slo.tpot_ms / 1000, refuses, args.max_num_seqs)
    )
    config = AutoscaleConfig(args.autoscale_interval, args.worker_start_s)
    return SimAutoscaler(cluster, planner, config, tracked)


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        if args.fluid:
            from pdserve.simulator.fluid_run import print_fluid, simulate_fluid

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
