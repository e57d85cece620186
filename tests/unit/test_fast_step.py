"""Steady steps applied without the engine (``pdserve.simulator.fast_step``): a whole simulated
run is the step-by-step engines' run, metric for metric, whatever the layout, schedule, budget,
block size, memory pressure, prefix sharing or early stop."""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.bench.workload import RequestSpec, arrival_times
from pdserve.planning.simulate import add_simulate_args, simulate
from pdserve.steptime.roofline import H100_LLAMA3_8B as P

LAYOUTS = (
    ("--colocated", "2"),
    ("--colocated", "2", "--colocated-schedule", "prefill-priority"),
    ("--prefill", "1", "--decode", "2"),
    ("--prefill", "1", "--decode", "2", "--policy", "goodput"),  # decode workers prefill short prompts
)


def args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    return p.parse_args(list(flags))


def workload(seed: int, n: int, prompt: int, output: int, rate: float, shared: int) -> list[RequestSpec]:
    """``n`` requests; with ``shared`` > 0, prompts start with one of three shared prefixes of
    ``shared`` tokens (prefix-cache hits, and equal blocks published by several requests)."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1000) for _ in range(shared)) for _ in range(3)]
    specs = []
    for t in arrival_times(n, rate, 1.0, rng):
        length = rng.randint(max(1, prompt // 4), prompt)
        head = rng.choice(prefixes)[:length] if shared else ()
        ids = head + tuple(rng.randrange(1000) for _ in range(length - len(head)))
        specs.append(RequestSpec(t, ids, length, rng.randint(1, output)))
    return specs


def run(flags: list[str], specs: list[RequestSpec], **extra: Any) -> dict[str, Any]:
    """The run's metrics, and each worker's prefix cache as the run left it (what is cached,
    what was evicted, hit and asked for): state the metrics may not show."""
    from pdserve.simulator.cluster import Cluster

    pools: list[tuple[Any, ...]] = []
    real = Cluster.run

    def run_and_look(cluster: Cluster) -> None:
        real(cluster)
        for w in cluster.by_id.values():
            p = w.kv.pool
            pools.append((w.wid, p.stats(), p.num_evictions, p.num_hits, p.num_queries, sorted(p._by_key)))

    mp = pytest.MonkeyPatch()
    mp.setattr(Cluster, "run", run_and_look)
    try:
        m = simulate(argparse.Namespace(**{**vars(args(*flags)), **extra}), list(specs))
    finally:
        mp.undo()
    m.pop("simulation_wall_s")
    m["pools"] = pools
    return m


@pytest.fixture(scope="module")
def small_memory(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A profile whose KV pool holds about 3,000 tokens: decode runs out of blocks and preempts."""
    tiny = dataclasses.replace(P, name="tiny-kv", memory_bytes=P.weight_bytes + 3400 * P.kv_bytes_per_token)
    path: Path = tmp_path_factory.mktemp("profiles") / "tiny-kv.json"
    path.write_text(tiny.to_json())
    return str(path)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 1 << 16),
    prompt=st.integers(8, 900),
    output=st.integers(1, 80),
    rate=st.sampled_from([20.0, 300.0, float("inf")]),
    shared=st.sampled_from([0, 48, 300]),
    budget=st.sampled_from(["24", "128", "2048"]),
    block=st.sampled_from(["4", "16"]),
    seqs=st.sampled_from(["3", "64"]),
    tight=st.booleans(),
    stop=st.sampled_from([None, 0.9]),
)
def test_fast_steps_give_the_engines_run(
    small_memory: str,
    layout: tuple[str, ...],
    seed: int,
    prompt: int,
    output: int,
    rate: float,
    shared: int,
    budget: str,
    block: str,
    seqs: str,
    tight: bool,
    stop: float | None,
) -> None:
    flags = [*layout, "--max-num-batched-tokens", budget, "--block-size", block, "--max-num-seqs", seqs,
             "--goodput", "ttft:300", "tpot:40", "--profile", small_memory if tight else P.name]  # fmt: skip
    specs = workload(seed, 30, prompt, output, rate, shared)
    engines = run([*flags, "--no-fast-steps"], specs, stop_below=stop)
    fast = run(flags, specs, stop_below=stop)
    assert fast == engines


def test_the_fast_path_runs_and_leaves_the_engines_clean() -> None:
    """Not a vacuous equality: most steps of a decode-heavy run take the fast path, and the run
    ends with every engine idle and its pool consistent (``Cluster.run``'s leak check)."""
    from pdserve.decode_worker.engine import DecodeEngine

    calls = {"engine": 0}
    step = DecodeEngine.step

    def counted(self: DecodeEngine) -> Any:
        calls["engine"] += 1
        return step(self)

    specs = workload(1, 40, 600, 200, 30.0, 48)
    flags = ["--colocated", "2", "--max-num-batched-tokens", "128", "--goodput", "ttft:300", "tpot:40"]
    mp = pytest.MonkeyPatch()
    mp.setattr(DecodeEngine, "step", counted)
    try:
        run([*flags, "--no-fast-steps"], specs)
        every = calls["engine"]
        calls["engine"] = 0
        run(flags, specs)
    finally:
        mp.undo()
    assert calls["engine"] < every / 5


def test_a_workers_load_during_a_run_is_the_load_after_its_steps() -> None:
    """The router reads a worker's load mid-run without applying the run's steps: it must be
    exactly the load the engine reports once they are applied (free and cached blocks)."""
    from pdserve.simulator.sim_worker import SimWorker

    seen = {"mid_run": 0}
    real = SimWorker.load

    def checked_load(self: SimWorker) -> Any:
        lazy = real(self)
        run = self.run
        if run is not None and run.pending_grows():
            seen["mid_run"] += 1
            run.apply(run.started)
            assert lazy == self._engine.load()
            self._load = None
        return lazy

    specs = workload(3, 60, 700, 300, 40.0, 0)
    mp = pytest.MonkeyPatch()
    mp.setattr(SimWorker, "load", checked_load)
    try:
        run(["--colocated", "3", "--block-size", "4", "--goodput", "ttft:300", "tpot:40"], specs)
    finally:
        mp.undo()
    assert seen["mid_run"] > 20
