"""A workload through the simulated cluster, reported like ``pdserve bench``: the event simulator's run.

``pdserve simulate`` (``pdserve.planning.simulate``) judges such a run against the workload's work
bound and can let the autoscaling planner resize the simulated pools while it runs."""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import RequestResult, Slo, summarize
from pdserve.bench.runner import add_workload_args, build_workload
from pdserve.bench.workload import RequestSpec
from pdserve.flags import (
    add_block_size,
    add_goodput,
    add_layout,
    add_policy,
    add_result,
    add_scheduler,
    colocated_count,
    layout_label,
    pool_degrees,
)
from pdserve.model_runtime.backend import GPU_MAX_SEQS, GPU_STEP_TOKENS
from pdserve.model_runtime.scheduler.plan import ColocatedSchedule, QueuePolicy, SchedulerConfig
from pdserve.router.config import RouterConfig
from pdserve.router.dispatchers import make_dispatcher
from pdserve.router.slo import Admission, SloClass
from pdserve.simulator.calibration import load_sim_profile
from pdserve.simulator.cluster import Cluster
from pdserve.simulator.early_stop import EarlyStop
from pdserve.simulator.prompt_memo import checked
from pdserve.simulator.sim_request import SimRequest
from pdserve.steptime.model import StepTimeModel
from pdserve.steptime.parallel import at_tp


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
        "--routers",
        type=int,
        default=1,
        help="router replicas (pdserve serve --routers): each request lands on one at random, each "
        "its own dispatcher, hearing the others' work only through the workers' load reports",
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


@dataclass
class Simulation:
    """One run of a workload on a layout: the cluster built and the workload submitted
    (``build``), then run and summarised (``run``). Between the two, whoever drives the run may
    attach to the cluster what acts on it meanwhile (``pdserve.planning.sim_autoscale``)."""

    args: argparse.Namespace
    profile: StepTimeModel  # the decode workers' (colocated engines') at their degree
    specs: list[RequestSpec]
    cluster: Cluster
    tracked: list[SimRequest]
    # as the cluster sees them (the work bound's workload), and the requests refused up front
    submitted: list[RequestSpec]
    results: list[RequestResult]
    slo: Slo
    colocated: int
    schedule: ColocatedSchedule
    admission: Admission
    degrees: tuple[int, int] = (1, 1)  # tensor-parallel (prefill, decode): GPUs a worker spans
    end: float = 0.0  # the last token's time, once run

    @property
    def gpus(self) -> int:
        """GPUs the layout holds: each worker spans its pool's degree."""
        ptp, dtp = self.degrees
        return self.colocated * dtp if self.colocated else self.args.prefill * ptp + self.args.decode * dtp

    @classmethod
    def build(cls, args: argparse.Namespace, specs: list[RequestSpec] | None = None) -> Simulation:
        degrees = pool_degrees(args)
        base = load_sim_profile(args.profile)
        # each pool's workers at their degree (refused, naming the valid ones, where it does not fit)
        profile, prefill_profile = at_tp(base, degrees[1]), at_tp(base, degrees[0])
        specs = specs if specs is not None else workload(args)
        schedule = ColocatedSchedule(getattr(args, "colocated_schedule", ColocatedSchedule.CHUNKED.value))
        cfg = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            policy=QueuePolicy.PRIORITY, colocated=schedule,
        )  # fmt: skip
        # Decode workers of a split prefill only locally (conditional disaggregation): their own,
        # usually smaller, chunk budget keeps those chunks from stalling the batch.
        decode_budget = getattr(args, "decode_max_num_batched_tokens", 0) or args.max_num_batched_tokens
        colocated = colocated_count(args)
        decode_cfg = cfg if colocated else replace(cfg, max_num_batched_tokens=decode_budget)
        slo = Slo.parse(args.goodput)
        admission = Admission(getattr(args, "admission", "none"))
        slo_class = SloClass("sim", (slo.ttft_ms or 0.0), (slo.tpot_ms or 0.0), admission)
        routers = getattr(args, "routers", 1)
        if routers < 1:
            raise ValueError(f"--routers must be >= 1, got {routers}")
        dispatchers = [
            make_dispatcher(
                args.policy,
                profile,
                args.block_size,
                getattr(args, "local_prefill", True),
                local_step_tokens=decode_cfg.max_num_batched_tokens,
                prefill_step_tokens=cfg.max_num_batched_tokens,
                prefill_profile=prefill_profile,
            )
            for _ in range(routers)
        ]
        cluster = Cluster(
            profile, args.prefill, args.decode, colocated, dispatchers, cfg, decode_cfg, args.block_size,
            slo_class, shared_host=getattr(args, "shared_host", False),
            jitter_seed=getattr(args, "jitter_seed", 0),
            reserve_timeout_s=getattr(args, "reserve_timeout_s", RouterConfig.reserve_timeout_s),
            fast_steps=getattr(args, "fast_steps", True), prefill_profile=prefill_profile,
            replica_seed=getattr(args, "seed", 0),
        )  # fmt: skip
        capacity = min(w.kv.num_blocks for w in cluster.decoders) * args.block_size
        results: list[RequestResult] = []
        tracked = []
        submitted: list[RequestSpec] = []
        for i, s in enumerate(specs):
            prompt = checked(s.prompt if isinstance(s.prompt, tuple) else tuple(range(s.prompt_len)))
            if s.prompt_len + s.output_len > min(profile.max_model_len, capacity):
                results.append(RequestResult(s.prompt_len, error="INVALID_ARGUMENT: exceeds the context"))
                continue
            tracked.append(cluster.submit(s.arrival_s, f"r{i}", prompt, s.output_len))
            submitted.append(RequestSpec(s.arrival_s, prompt, s.prompt_len, s.output_len))
        return cls(
            args, profile, specs, cluster, tracked, submitted, results, slo, colocated, schedule, admission,
            degrees,
        )  # fmt: skip

    def run(self) -> dict[str, Any]:
        """Runs the cluster to its end; the workload's metrics (``pdserve bench``'s names)."""
        args, cluster, specs, results = self.args, self.cluster, self.specs, self.results
        stop_below = getattr(args, "stop_below", None)
        if stop_below is not None and specs and not self.slo.empty:
            cluster.early_stop = EarlyStop(
                self.slo, len(specs), stop_below, len(results), on_pass=getattr(args, "stop_on_pass", True)
            )
            cluster.watch_deadlines(self.tracked)
        t0 = time.perf_counter()
        with _no_gc():
            cluster.run()
        wall = time.perf_counter() - t0
        end = 0.0
        for sr in self.tracked:
            r = sr.result()
            results.append(r)
            if r.success:
                end = max(end, sr.token_times[-1])
        self.end = end
        duration = end - min((s.arrival_s for s in specs), default=0.0)
        m = summarize(results, duration, Slo.parse(args.goodput))
        if cluster.early_stop is not None and cluster.early_stop.stopped:
            # The other metrics describe the requests finished by then; attainment is what the
            # point was known to reach on its side of the target (the most a failing one could
            # still reach, the least a passing one reaches).
            m["slo_attainment"] = cluster.early_stop.attainment_bound
            m["stopped_early"] = True
        colocated = self.colocated
        m.update(
            {
                "simulated": True,
                "profile": self.profile.name,
                "layout": layout_label(args.prefill, args.decode, colocated, *self.degrees),
                "gpus": self.gpus,
                "policy": args.policy,
                "routers": cluster.routers,
                "colocated_schedule": self.schedule.value,
                "admission": self.admission.value,
                "decisions": dict(sorted(cluster.decisions.items())),
                "num_prompts": len(specs),
                "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                "simulation_wall_s": wall,
                # GPU-seconds held: every worker from its start to its stop (or the last token)
                "worker_seconds": cluster.worker_seconds(end),
            }
        )
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
