"""Prefill-priority colocation (vLLM v0's scheduler, DistServe's baseline): a step is whole
prompts only or decodes only, prompts first; outputs stay exact and nothing leaks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.scheduler import ColocatedScheduler, SchedulerConfig
from pdserve.model_runtime.scheduler.plan import ColocatedSchedule, SchedulePlan
from tests.unit.test_schedulers import expected_output, fake_execute, make_req

PP = ColocatedSchedule.PREFILL_PRIORITY


def sched(budget: int, num_blocks: int = 64, max_seqs: int = 16) -> ColocatedScheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, colocated=PP)
    return ColocatedScheduler(KVCacheManager(num_blocks, 16), cfg)


def step(s: ColocatedScheduler, reqs: dict[str, Request]) -> SchedulePlan:
    plan = s.schedule()
    s.update(plan, fake_execute(plan, reqs))
    s.kv.check_integrity()
    return plan


def shape(plan: SchedulePlan) -> list[tuple[str, int]]:
    return [(c.request_id, c.num_tokens) for c in plan.chunks]


def test_prompts_interrupt_decodes_and_run_whole() -> None:
    s = sched(budget=100)
    a, b, c, d = make_req("a", 40, 5), make_req("b", 150, 5), make_req("c", 30, 5), make_req("d", 50, 5)
    reqs = {r.request_id: r for r in (a, b, c, d)}
    s.add_request(a)
    assert shape(step(s, reqs)) == [("a", 40)]
    assert shape(step(s, reqs)) == [("a", 1)]  # nothing waiting: a decode step
    s.add_request(b)  # longer than the budget: goes alone, unchunked, ahead of a's decode
    s.add_request(c)
    assert shape(step(s, reqs)) == [("b", 150)]
    s.add_request(d)
    assert shape(step(s, reqs)) == [("c", 30), ("d", 50)]  # packed up to the budget
    assert shape(step(s, reqs)) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]


def test_fcfs_whole_prompts_do_not_overtake() -> None:
    s = sched(budget=100)
    reqs = {r.request_id: r for r in (make_req("x", 60, 3), make_req("y", 60, 3), make_req("z", 10, 3))}
    for r in reqs.values():
        s.add_request(r)
    # y does not fit what x leaves; z, behind it, waits too (no skipping: no starvation).
    assert shape(step(s, reqs)) == [("x", 60)]
    assert shape(step(s, reqs)) == [("y", 60), ("z", 10)]


def test_sequence_limit_counts_running_decodes() -> None:
    s = sched(budget=1000, max_seqs=2)
    reqs = {r.request_id: r for r in (make_req(f"r{i}", 20, 4) for i in range(3))}
    for r in reqs.values():
        s.add_request(r)
    assert shape(step(s, reqs)) == [("r0", 20), ("r1", 20)]
    assert shape(step(s, reqs)) == [("r0", 1), ("r1", 1)]  # full: r2 waits for a slot


def test_chunked_is_still_the_default() -> None:
    assert SchedulerConfig().colocated is ColocatedSchedule.CHUNKED
    s = ColocatedScheduler(KVCacheManager(64, 16), SchedulerConfig(max_num_batched_tokens=100))
    reqs = {r.request_id: r for r in (make_req("a", 40, 5), make_req("b", 150, 5))}
    s.add_request(reqs["a"])
    step(s, reqs)
    s.add_request(reqs["b"])
    assert shape(step(s, reqs)) == [("a", 1), ("b", 99)]  # decode first, then a chunk


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(
        st.tuples(st.integers(1, 90), st.integers(1, 30), st.integers(0, 20)), min_size=1, max_size=10
    ),
    num_blocks=st.integers(8, 40),
    budget=st.integers(8, 128),
    max_seqs=st.integers(1, 8),
)
def test_property_exact_and_leak_free(
    lens: list[tuple[int, int, int]], num_blocks: int, budget: int, max_seqs: int
) -> None:
    s = sched(budget, num_blocks, max_seqs)
    arrivals: dict[int, list[Request]] = {}
    reqs: dict[str, Request] = {}
    for i, (n_prompt, n_out, at) in enumerate(lens):
        n_prompt = min(n_prompt, num_blocks * 16 - n_out)  # admission: each fits the pool alone
        r = make_req(f"r{i}", n_prompt, n_out, seed=i % 3)
        reqs[r.request_id] = r
        arrivals.setdefault(at, []).append(r)
    done: set[str] = set()
    for t in range(20_000):
        for r in arrivals.get(t, []):
            s.add_request(r)
        if not s.has_work and t > max(arrivals):
            break
        plan = s.schedule()
        kinds = {s.decode.is_scheduled(c.request_id) for c in plan.chunks}
        assert len(kinds) <= 1, "a step mixes prefill and decode"
        if kinds == {False} and len(plan.chunks) > 1:
            assert plan.num_tokens <= budget  # only a lone prompt may exceed the budget
        up = s.update(plan, fake_execute(plan, reqs))
        done |= {r.request_id for r in up.finished}
        s.kv.check_integrity()
    assert done == set(reqs)
    for r in reqs.values():
        assert r.output_token_ids == expected_output(list(r.prompt_token_ids), r.params.max_tokens)
    assert s.kv.check_integrity().used == 0
