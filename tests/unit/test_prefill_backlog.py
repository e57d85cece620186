"""The prefill pool's backlog: what a step in the load leaves queued is priced by the capacity
model (the TTFT of a request arriving ``drain_s`` from now, behind what is left of it), sized
for by the planner, and measured the same way by the router, the event simulator and the fluid
model (prompt tokens sent to a prefill worker with no first token yet)."""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import replace
from typing import Any

import pytest

from pdserve.deploy.capacity import predict
from pdserve.deploy.planner import Planner
from pdserve.deploy.planner_data import Bounds, Layout, Observation, PlannerConfig, Reason
from pdserve.router.service import GenerateInput
from pdserve.router.workload_window import Workload
from pdserve.simulator.calibration import load_sim_profile
from pdserve.simulator.fluid import FluidCluster, FluidConfig
from pdserve.steptime.roofline import H100_LLAMA3_8B as H100
from pdserve.worker.messages import TokenDelta, WorkerRole
from tests.unit.test_fluid import arrivals, drive
from tests.unit.test_router_migration import GREEDY, cluster, settle

CONV = Workload(20.0, 1263.0, 209.0, prompt_tail_tokens=2500.0)
SLO = PlannerConfig(ttft_s=0.25, tpot_s=0.1, bounds=Bounds(1, 8, 1, 8))


def ttft(prefill: int, backlog: float, drain_s: float = 15.0) -> float:
    return predict(H100, CONV, prefill, 4, 0.9, backlog_tokens=backlog, drain_s=drain_s).ttft_s


def test_a_backlog_drained_in_time_costs_nothing_and_more_workers_drain_a_larger_one() -> None:
    steady = ttft(2, 0.0)
    assert ttft(2, 5_000.0) == steady  # cleared by the spare capacity within drain_s
    assert ttft(2, 0.0, drain_s=0.0) == steady  # no backlog: the steady state alone
    queued = [ttft(p, 5_000_000.0) for p in (2, 3, 4, 6)]
    assert queued[0] > steady + 1.0  # two workers are still on it 15 s from now
    assert all(a > b for a, b in itertools.pairwise(queued))  # more workers: sooner
    # the backlog's own share: what is left after drain_s of spare capacity, over the pool
    s = H100.prefill_time(1263)
    left = 5_000_000.0 * s / 1263 - (4 - CONV.rate * s) * 15.0
    assert queued[2] - ttft(4, 0.0) == pytest.approx(left / 4, rel=1e-6)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_absurd_backlogs_and_drain_times_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="backlog_tokens"):
        predict(H100, CONV, 2, 2, backlog_tokens=bad)
    with pytest.raises(ValueError, match="drain_s"):
        predict(H100, CONV, 2, 2, drain_s=bad)
    with pytest.raises(ValueError, match="drain_s"):
        PlannerConfig(0.25, 0.1, drain_s=bad)


def test_a_step_grows_the_prefill_pool_for_the_queue_it_left() -> None:
    """The same check window after a step, with and without the queue the step built on one
    prefill worker: sized for the rate alone, the new workers would still be on that queue
    long after they started."""
    step = Observation(10.0, Layout(1, 2), replace(CONV, rate=60.0, span_s=10.0))
    bare = Planner(H100, SLO).decide(step, up_only=True)
    queued = Planner(H100, SLO).decide(replace(step, queued_prompt_tokens=600 * 1263.0), up_only=True)
    assert bare.reason is Reason.SCALE_UP and queued.reason in (Reason.SCALE_UP, Reason.OVERLOADED)
    assert queued.layout.prefill > bare.layout.prefill
    assert queued.predicted.ttft_s <= SLO.ttft_s or queued.reason is Reason.OVERLOADED


def test_the_router_counts_prompts_sent_to_prefill_until_their_first_token() -> None:
    async def main() -> None:
        roles = [("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE)]
        router, ws = cluster(roles, policy="round_robin")
        a = router.admit(GenerateInput([5, 6, 7, 8], GREEDY))
        b = router.admit(GenerateInput([1, 2], GREEDY))
        assert router.queued_prompt_tokens() == 0  # admitted, not yet sent anywhere
        tasks = [asyncio.create_task(_drain(router.run(x))) for x in (a, b)]
        await settle()
        assert router.queued_prompt_tokens() == 6
        router._on_deltas(ws["p0"].handle, (TokenDelta(a.stream.request_id, (9,), prefilled=True),))
        await settle()
        assert router.queued_prompt_tokens() == 2  # a's first token is out
        for t in tasks:
            t.cancel()
        await settle()
        assert router.queued_prompt_tokens() == 0 and not router._streams

    asyncio.run(main())


async def _drain(events: Any) -> None:
    async for _ in events:
        pass


def test_the_fluid_model_counts_what_its_prefill_steps_have_not_done() -> None:
    model = load_sim_profile("h100-llama3-8b")
    c = FluidCluster(model, 1, 1, FluidConfig(ttft_s=0.25, tpot_s=0.1, step_tokens=8192))
    assert c.queued_prompt_tokens(0.0) == 0
    rows = [(0.0, 4000, 4)] * 40  # 160k tokens at once: seconds of one worker's prefill
    c.tick(0.5, arrivals(rows)[0])
    queued = c.queued_prompt_tokens(c.now)
    assert 0 < queued <= 160_000
    assert c.queued_prompt_tokens(c.now + 1.0) < queued  # its steps go on
    drive(c, [])
    assert c.queued_prompt_tokens(c.now) == 0
