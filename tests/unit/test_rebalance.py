"""Which prompts that have not started move when the prefill pool changes
(``pdserve.router.rebalance``), and the prefill engine's answer to ``withdraw``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.router.dispatchers import make_dispatcher
from pdserve.router.policy import Decision, Outcome, RouteRequest
from pdserve.router.rebalance import Queued, Waiting, queue_of, withdrawals, worth_moving
from pdserve.simulator.cluster import Cluster
from pdserve.simulator.sim_request import SimRequest
from pdserve.simulator.virtual import Clock, Link, SimRuntime, SimTransport
from pdserve.steptime.roofline import H100_LLAMA3_8B
from pdserve.worker.messages import WorkerRole, WorkItem


def queue(prefix: str, *tokens: int) -> list[Queued]:
    return [Queued(f"{prefix}{i}", n) for i, n in enumerate(tokens)]


def test_a_queue_is_read_oldest_dispatch_first_each_judged_at_now() -> None:
    """What the router and the simulator both hand ``withdrawals``: oldest dispatch first (ties
    by id), movable while less than half the TTFT target is gone."""
    waiting = [
        Waiting("b", dispatched_at=2.0, arrival=0.0, tokens=10, ttft_target_ms=1000),
        Waiting("a", dispatched_at=1.0, arrival=1.0, tokens=20, ttft_target_ms=1000),
        Waiting("c", dispatched_at=2.0, arrival=1.4, tokens=30, ttft_target_ms=0),
    ]
    assert queue_of(waiting, now=1.6) == [
        Queued("a", 20, movable=False),  # 600 ms of 1000: late already
        Queued("b", 10, movable=False),
        Queued("c", 30, movable=True),  # no target: always
    ]
    assert queue_of(waiting, now=1.2)[0] == Queued("a", 20, movable=True)


def test_a_joined_worker_takes_the_newest_half_of_the_backlog() -> None:
    plan = withdrawals({"p0": queue("a", *[100] * 10), "p1": []}, ["p0", "p1"], min_tokens=0)
    assert plan == {"p0": ["a9", "a8", "a7", "a6", "a5"]}


def test_an_even_pool_or_one_within_a_step_moves_nothing() -> None:
    assert withdrawals({"p0": queue("a", 100, 100), "p1": queue("b", 300)}, ["p0", "p1"], 0) == {}
    assert withdrawals({"p0": queue("a", *[100] * 6), "p1": []}, ["p0", "p1"], min_tokens=300) == {}
    assert withdrawals({"p0": queue("a", *[100] * 7), "p1": []}, ["p0", "p1"], min_tokens=300) != {}


def test_a_worker_leaving_gives_back_everything_and_with_none_open_nothing_moves() -> None:
    queues = {"p0": queue("a", 50, 60), "p1": queue("b", 10)}
    assert withdrawals(queues, ["p1"], min_tokens=10_000) == {"p0": ["a1", "a0"]}
    assert withdrawals(queues, [], min_tokens=0) == {}
    with pytest.raises(ValueError):
        withdrawals(queues, ["p1"], min_tokens=-1)


def test_a_prompt_late_already_stays_unless_its_worker_leaves() -> None:
    assert worth_moving(5.0, 0.0) and worth_moving(999.0, 2000.0)
    assert not worth_moving(1000.0, 2000.0) and not worth_moving(float("inf"), 2000.0)
    q = [Queued(f"a{i}", 100, movable=i >= 7) for i in range(10)]  # a0-a6 used half their budget
    assert withdrawals({"p0": q, "p1": []}, ["p0", "p1"], 0) == {"p0": ["a9", "a8", "a7"]}
    assert withdrawals({"p0": q, "p1": []}, ["p1"], 0) == {"p0": [f"a{i}" for i in range(9, -1, -1)]}


def test_a_long_prompt_stays_when_it_would_wait_no_less_elsewhere() -> None:
    # 4,000 tokens behind 1,000: the share is 2,500, and the long prompt's middle (3,000) is
    # past it: it moves; the 1,000 ahead of it stays.
    assert withdrawals({"p0": queue("a", 1000, 4000), "p1": []}, ["p0", "p1"], 0) == {"p0": ["a1"]}
    # 4,000 ahead of 1,000: the short one's middle (4,500) is past the share and moves; the long
    # one's middle (2,000) is not.
    assert withdrawals({"p0": queue("a", 4000, 1000), "p1": []}, ["p0", "p1"], 0) == {"p0": ["a1"]}


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(
        st.lists(st.tuples(st.integers(1, 5000), st.booleans()), max_size=12), min_size=1, max_size=5
    ),
    open_mask=st.lists(st.booleans(), min_size=5, max_size=5),
    extra_open=st.integers(0, 3),
    min_tokens=st.integers(0, 4000),
)
def test_withdrawals_take_only_newest_prompts_and_never_overshoot(
    sizes: list[list[tuple[int, bool]]], open_mask: list[bool], extra_open: int, min_tokens: int
) -> None:
    queues = {
        f"p{i}": [Queued(f"w{i}-{j}", n, movable) for j, (n, movable) in enumerate(s)]
        for i, s in enumerate(sizes)
    }
    open_workers = [w for w, o in zip(queues, open_mask, strict=False) if o]
    open_workers += [f"new{i}" for i in range(extra_open)]
    plan = withdrawals(queues, open_workers, min_tokens)
    if not open_workers:
        assert plan == {}
        return
    share = sum(q.tokens for qs in queues.values() for q in qs) / len(open_workers)
    for wid, taken in plan.items():
        q = queues[wid]
        assert taken, wid
        assert taken == [x.request_id for x in reversed(q)][: len(taken)]  # a suffix, newest first
        if wid in open_workers:
            kept = q[: len(q) - len(taken)]
            kept_tokens = sum(x.tokens for x in kept)
            oldest_taken = q[len(kept)]
            assert kept_tokens + oldest_taken.tokens / 2 > share  # its middle was past the share
            assert all(x.movable for x in q[len(kept) :])  # none late already
            if kept:  # and the newest one kept has its middle within it, or is late
                assert kept_tokens - kept[-1].tokens / 2 <= share or not kept[-1].movable
    for w in queues:
        if w not in open_workers and queues[w]:
            assert len(plan[w]) == len(queues[w])  # a worker leaving gives back everything
    if any(w in open_workers for w in plan):  # open workers even out only when one is a step off
        assert any(sum(x.tokens for x in queues[w]) - share > min_tokens for w in open_workers if w in queues)


def engine() -> PrefillEngine:
    clock = Clock()
    kv = KVCacheManager(64, 16)
    rt = SimRuntime(kv, 16, 4096)
    transport = SimTransport("p0", Link(clock, H100_LLAMA3_8B), lambda: None)
    return PrefillEngine(rt, transport, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), "p0")


def work(rid: str, n: int) -> WorkItem:
    return WorkItem(rid, tuple(range(3, 3 + n)), SamplingParams(max_tokens=4, temperature=0.0))


def test_only_a_prompt_that_has_not_started_is_given_back() -> None:
    eng = engine()
    for rid, n in (("a", 100), ("b", 40), ("c", 40)):
        eng.add(work(rid, n))
    eng.step()  # a's first chunk (64 tokens): a started, b and c wait
    assert not eng.withdraw("a")
    assert not eng.withdraw("nobody")
    assert eng.withdraw("c")
    assert not eng.withdraw("c")  # forgotten: a second answer is no
    eng.add(work("c", 40))  # the id is free again on this worker
    assert eng.withdraw("c")
    assert eng.abort("a") and eng.abort("b")
    assert eng.idle
    assert not any(eng.request_state().values()), eng.request_state()
    assert eng.kv.check_integrity().used == 0


class RefusesAgain:
    """Least-loaded routing that predicts every prompt routed again late (REJECTED)."""

    def __init__(self) -> None:
        self.inner = make_dispatcher("least_loaded")
        self.name = "refuses-again"

    def decide(self, request: RouteRequest, *args: Any) -> Decision:
        d = self.inner.decide(request, *args)
        return replace(d, outcome=Outcome.REJECTED) if "~" in request.request_id else d

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def simulated_join(rebalance: bool, dispatcher: Any = None) -> tuple[Cluster, list[SimRequest]]:
    """One prefill worker takes 40 prompts of 4,000 tokens in 0.16 s (about 3.6 s of work); a
    second one joins at 0.2 s."""
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64)
    cluster = Cluster(H100_LLAMA3_8B, 1, 1, 0, dispatcher or make_dispatcher("least_loaded"), cfg, cfg,
                      rebalance_prefill=rebalance)  # fmt: skip
    reqs = [cluster.submit(0.004 * i, f"r{i}", tuple(range(i * 5000, i * 5000 + 4000)), 8) for i in range(40)]
    cluster.clock.at(0.2, lambda: cluster.add_worker(WorkerRole.PREFILL))
    cluster.run()  # (it checks that every worker ends with nothing held)
    return cluster, reqs


def test_the_simulator_moves_prompts_as_the_router_does() -> None:
    moved, moved_reqs = simulated_join(True)
    kept, kept_reqs = simulated_join(False)
    assert kept.rerouted == 0 and moved.rerouted >= 5
    for reqs in (moved_reqs, kept_reqs):
        assert all(r.result().success and r.result().output_len == 8 for r in reqs)
    worst = [max(r.result().ttft for r in reqs) for reqs in (moved_reqs, kept_reqs)]
    assert worst[0] < 0.6 * worst[1], worst
    assert {r.work.request_id for r in moved_reqs if "~" in r.work.request_id}  # a fresh id each move


def test_a_simulated_prompt_routed_again_is_served_even_if_predicted_late() -> None:
    """As the router: admitted once, it is not refused when it moves."""
    cluster, reqs = simulated_join(True, RefusesAgain())
    assert cluster.rerouted >= 5
    assert all(r.result().success for r in reqs)


def test_a_simulated_prefill_worker_leaving_gives_back_what_it_had_not_started() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64)
    cluster = Cluster(H100_LLAMA3_8B, 2, 1, 0, make_dispatcher("round_robin"), cfg, cfg)
    reqs = [cluster.submit(0.001 * i, f"r{i}", tuple(range(i * 5000, i * 5000 + 4000)), 8) for i in range(20)]
    leaving = cluster.prefillers[0]
    cluster.clock.at(0.05, lambda: cluster.retire(leaving))
    cluster.run()
    assert all(r.result().success for r in reqs)
    assert cluster.rerouted >= 5
    stop = cluster.lifetimes[leaving.wid][1]
    assert stop < 0.05 + 0.3  # it finished what it had started (a prompt or two), not its queue
