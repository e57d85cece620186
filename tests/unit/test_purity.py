"""Decisions are pure: the policies, schedulers, block manager, latency models, bench arithmetic,
the simulator and the planning room import no torch, Ray, gRPC, web or serialization stack, so
they run (and plan clusters) on any Python with the standard library."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PURE = (
    "pdserve.router.policy",
    "pdserve.router.goodput",
    "pdserve.router.predictor",
    "pdserve.router.slo",
    "pdserve.router.prefix",
    "pdserve.router.dispatchers",
    "pdserve.model_runtime.scheduler",
    "pdserve.model_runtime.kv_cache.manager",
    "pdserve.steptime.load",
    "pdserve.simulator.calibration",
    "pdserve.simulator.cluster",
    "pdserve.simulator.sim_request",
    "pdserve.simulator.sim_worker",
    "pdserve.flags",
    "pdserve.deploy.pools",
    "pdserve.planning.planner",
    "pdserve.planning.planner_data",
    "pdserve.planning.load_memory",
    "pdserve.planning.keep_up",
    "pdserve.planning.error_budget",
    "pdserve.planning.step_correction",
    "pdserve.planning.capacity",
    "pdserve.router.workload_window",
    "pdserve.router.rebalance",
    "pdserve.router.lifecycle",
    "pdserve.planning.sim_autoscale",
    "pdserve.worker.spec",
    "pdserve.kvtransfer.config",
    "pdserve.kvtransfer.admission",
    "pdserve.kvtransfer.heads",
    "pdserve.model_runtime.config",
    "pdserve.model_runtime.attention_tuning",
    "pdserve.worker.ports",
    "pdserve.prefill_worker.engine",
    "pdserve.decode_worker.engine",
    "pdserve.bench.metrics",
    "pdserve.bench.workload",
    "pdserve.bench.sweep",
    "pdserve.bench.runner",
    "pdserve.simulator.run",
    "pdserve.planning.plan",
    "pdserve.planning.plan_candidates",
    "pdserve.planning.plan_jobs",
    "pdserve.planning.plan_report",
    "pdserve.planning.simulate",
    "pdserve.planning.settings",
    "pdserve.planning.bound",
    "pdserve.planning.autoscale",
    "pdserve.simulator.service_fit",
    "pdserve.simulator.jitter",
    "pdserve.model_runtime.engine.step_log",
    "pdserve.model_runtime.sampling.logprob",
    "pdserve.worker.messages",
    "pdserve.worker.kv_events",
    "pdserve.worker.commands",
    "pdserve.worker.control",
    "pdserve.worker.handlers",
    "pdserve.prefill_worker.handlers",
    "pdserve.decode_worker.handlers",
    "pdserve.router.workers",
)
# The router's process routes requests without the model stack: its service, the worker clients
# and the output channel's codec load neither torch nor Ray (msgpack and asyncio are theirs).
NO_MODEL_STACK = (
    "pdserve.router.service",
    "pdserve.router.workers",
    "pdserve.router.outputs",
    "pdserve.worker.codec",
    "pdserve.worker.commands",
    "pdserve.worker.control",
)
HEAVY = {"torch", "ray", "grpc", "google", "fastapi", "starlette", "uvicorn", "httpx", "msgpack", "numpy"}


def loaded_by(module: str) -> set[str]:
    """Top-level packages a fresh interpreter holds after importing ``module``."""
    code = f"import sys, json, {module}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", PURE)
def test_module_imports_no_heavy_stack(module: str) -> None:
    loaded = loaded_by(module)
    assert not loaded & HEAVY, f"{module} pulls in {sorted(loaded & HEAVY)}"


@pytest.mark.parametrize("module", NO_MODEL_STACK)
def test_router_side_loads_no_torch_or_ray(module: str) -> None:
    loaded = loaded_by(module)
    assert not loaded & {"torch", "ray"}, f"{module} pulls in {sorted(loaded & {'torch', 'ray'})}"
