"""The simulated router's prefix index is fed by the simulated workers' real block pools, as a
router's is by its workers' output batches: after a run it holds exactly what each pool caches,
and it sends a prompt sharing a cached prefix to the worker that holds it."""

from __future__ import annotations

import argparse
import random

from pdserve.bench.workload import RequestSpec
from pdserve.router.goodput import GoodputPolicy
from pdserve.simulator.run import Simulation, add_simulate_args


def simulation(specs: list[RequestSpec], *flags: str) -> Simulation:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    args = p.parse_args(["--prefill", "2", "--decode", "2", "--policy", "goodput", *flags])
    return Simulation.build(args, specs)


def test_the_index_is_each_workers_pool_and_routes_to_the_holder() -> None:
    rng = random.Random(1)
    heads = [tuple(rng.randrange(32000) for _ in range(3000)) for _ in range(3)]
    specs = []
    for i in range(30):  # turns on three long prefixes, far enough apart for each to be cached
        prompt = heads[i % 3] + tuple(rng.randrange(32000) for _ in range(200))
        specs.append(RequestSpec(0.5 * i, prompt, len(prompt), 32))
    sim = simulation(specs)
    pol = sim.cluster.dispatcher
    assert isinstance(pol, GoodputPolicy)
    pol.prefix.hint_s = 0.0  # the workers' events alone
    sim.run()
    for w in sim.cluster.by_id.values():
        assert pol.prefix.holds(w.wid) == set(w.kv.pool.cached_keys()), w.wid
    assert sum(1 for w in sim.cluster.by_id.values() if pol.prefix.holds(w.wid)) >= 2
    late = [sr for sr in sim.tracked[3:]]  # every prefix was computed once before these came
    assert all(sr.cached >= 2900 for sr in late)
