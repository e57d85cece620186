"""Decisions are pure: the policies, schedulers, block manager, latency models, bench arithmetic
and the simulator import no torch, Ray, gRPC, web or serialization stack, so they run (and the
simulator plans clusters) on any Python with the standard library."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PURE = (
    "pdserve.router.policy",
    "pdserve.router.goodput",
    "pdserve.router.latency_model",
    "pdserve.router.slo",
    "pdserve.router.prefix",
    "pdserve.router.dispatchers",
    "pdserve.model_runtime.scheduler",
    "pdserve.model_runtime.kv_cache.manager",
    "pdserve.model_runtime.latency",
    "pdserve.bench.metrics",
    "pdserve.bench.workload",
    "pdserve.bench.sweep",
    "pdserve.bench.runner",
    "pdserve.simulator.run",
    "pdserve.simulator.plan",
    "pdserve.simulator.service_fit",
    "pdserve.simulator.jitter",
    "pdserve.model_runtime.engine.step_log",
)
HEAVY = {"torch", "ray", "grpc", "google", "fastapi", "starlette", "uvicorn", "httpx", "msgpack", "numpy"}


@pytest.mark.parametrize("module", PURE)
def test_module_imports_no_heavy_stack(module: str) -> None:
    code = f"import sys, json, {module}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not loaded & HEAVY, f"{module} pulls in {sorted(loaded & HEAVY)}"
