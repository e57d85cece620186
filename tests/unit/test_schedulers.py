"""Schedulers driven by a fake model: the next token is a pure function of all previous tokens,
so any run (chunked, preempted, recomputed, prefix-cached) must produce the same tokens as an
undisturbed one, and every scenario must end with zero blocks in use."""

from __future__ import annotations

import hashlib
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import FinishReason, Request, RequestStatus
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler import (
    ColocatedScheduler,
    DecodeScheduler,
    PrefillScheduler,
    SchedulerConfig,
)
from pdserve.model_runtime.scheduler.plan import QueuePolicy, SchedulePlan

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    return hashlib.blake2b(bytes(str(tokens), "ascii"), digest_size=4).digest()[0] % VOCAB


def expected_output(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt) :]


def fake_execute(plan: SchedulePlan, reqs: dict[str, Request]) -> dict[str, int]:
    """What a model would sample: checks the plan feeds exactly the request's tokens."""
    out = {}
    for c in plan.chunks:
        r = reqs[c.request_id]
        assert list(c.token_ids) == r.token_slice(c.start_pos, c.start_pos + c.num_tokens)
        assert len(c.block_table) * 16 >= c.start_pos + c.num_tokens
        if c.sample:
            out[c.request_id] = next_token(r.token_slice(0, c.start_pos + c.num_tokens))
    return out


def make_req(rid: str, n_prompt: int, max_tokens: int, seed: int = 0, priority: int = 0) -> Request:
    rng = random.Random(f"{rid}-{seed}")
    prompt = tuple(rng.randrange(VOCAB) for _ in range(n_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), priority=priority)


def run_colocated(
    sched: ColocatedScheduler, arrivals: dict[int, list[Request]], max_steps: int = 20_000
) -> dict[str, Request]:
    reqs: dict[str, Request] = {}
    done: dict[str, Request] = {}
    step = 0
    while step < max_steps and (sched.has_work or any(s >= step for s in arrivals)):
        for r in arrivals.get(step, []):
            reqs[r.request_id] = r
            sched.add_request(r)
        plan = sched.schedule()
        assert plan.num_tokens <= sched.config.max_num_batched_tokens or all(
            c.num_tokens == 1 for c in plan.chunks
        )
        update = sched.update(plan, fake_execute(plan, reqs))
        for r in update.finished:
            done[r.request_id] = r
        sched.kv.check_integrity()
        step += 1
    assert step < max_steps, "scheduler made no progress"
    return done


def test_prefill_budget_chunks_long_prompts_fcfs() -> None:
    kv = KVCacheManager(64, 16)
    s = PrefillScheduler(kv, SchedulerConfig(max_num_batched_tokens=100))
    a, b = make_req("a", 150, 4), make_req("b", 30, 4)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    chunks = plan.chunks
    assert [(c.request_id, c.num_tokens) for c in chunks] == [("a", 100)]
    s.update(plan, {})
    plan = s.schedule()
    chunks = plan.chunks
    assert [(c.request_id, c.num_tokens, c.start_pos) for c in chunks] == [("a", 50, 100), ("b", 30, 0)]
    assert all(c.sample for c in chunks)
    up = s.update(plan, {"a": 1, "b": 2})
    assert {r.request_id for r in up.prefilled} == {"a", "b"}
    assert all(r.status is RequestStatus.PREFILLED and r.output_token_ids for r in up.prefilled)


def test_priority_policy_orders_by_priority_then_arrival() -> None:
    kv = KVCacheManager(64, 16)
    s = PrefillScheduler(kv, SchedulerConfig(max_num_batched_tokens=10, policy=QueuePolicy.PRIORITY))
    for rid, prio in [("low", 5), ("high", 0), ("mid", 1), ("high2", 0)]:
        s.add(make_req(rid, 10, 2, priority=prio))
    order = []
    for _ in range(4):
        plan = s.schedule()
        chunks = plan.chunks
        order += [c.request_id for c in chunks]
        s.update(plan, {c.request_id: 0 for c in chunks})
    assert order == ["high", "high2", "mid", "low"]


def test_fcfs_head_of_line_is_not_overtaken() -> None:
    kv = KVCacheManager(4, 16)  # 64 tokens of room
    s = PrefillScheduler(kv, SchedulerConfig(max_num_batched_tokens=1000))
    big, small = make_req("big", 60, 2), make_req("small", 10, 2)
    hog = make_req("hog", 30, 2)
    s.add(hog)
    s.add(big)
    s.add(small)
    plan = s.schedule()
    chunks = plan.chunks
    assert [c.request_id for c in chunks] == ["hog"]  # big does not fit yet; small must wait behind it


def test_decode_joins_and_leaves_every_step() -> None:
    kv = KVCacheManager(64, 16)
    d = DecodeScheduler(kv, SchedulerConfig())
    reqs = {}
    for rid, n in [("a", 1), ("b", 3)]:
        r = make_req(rid, 5, n)
        assert kv.allocate_slots(r, 5)
        r.num_computed_tokens = 5
        r.append_token(next_token(list(r.prompt_token_ids)))
        r.num_computed_tokens = 5
        reqs[rid] = r
        d.add(r)
    plan = d.schedule()
    chunks, pre = plan.chunks, plan.preempted
    assert len(chunks) == 2 and not pre
    up = d.update(plan, {c.request_id: 7 for c in chunks})
    assert [r.request_id for r in up.finished] == ["a"]
    assert d.num_running == 1 and not kv.holds("a")


def test_decode_preempts_newest_when_blocks_run_out() -> None:
    kv = KVCacheManager(4, 4)
    d = DecodeScheduler(kv, SchedulerConfig())
    rs = []
    for rid in ["old", "new"]:
        r = make_req(rid, 7, 10)
        assert kv.allocate_slots(r, 8)
        r.num_computed_tokens = 7
        r.append_token(1)
        d.add(r)
        rs.append(r)
    # Both blocks are full after this token: the next step needs 2 new blocks, only 0 free.
    plan = d.schedule()
    chunks, pre = plan.chunks, plan.preempted
    assert [c.request_id for c in chunks] == ["old", "new"]
    d.update(plan, {"old": 2, "new": 3})
    plan = d.schedule()
    chunks, pre = plan.chunks, plan.preempted
    assert [r.request_id for r in pre] == ["new"] and [c.request_id for c in chunks] == ["old"]
    assert pre[0].status is RequestStatus.WAITING and pre[0].num_computed_tokens == 0
    assert pre[0].output_token_ids == [1, 3]  # generated tokens survive preemption
    kv.check_integrity()


def test_colocated_matches_undisturbed_run_under_a_tiny_pool() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=16)  # 192 tokens for 6 requests of up to 120
    sched = ColocatedScheduler(kv, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8))
    reqs = [make_req(f"r{i}", 20 + 15 * i, 40) for i in range(6)]
    done = run_colocated(sched, {0: reqs[:3], 7: reqs[3:]})
    assert set(done) == {r.request_id for r in reqs}
    assert sched.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == expected_output(list(r.prompt_token_ids), 40)
        assert r.finish_reason is FinishReason.LENGTH
    assert kv.check_integrity().used == 0


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    kv = KVCacheManager(32, 16)
    sched = ColocatedScheduler(kv, SchedulerConfig(max_num_batched_tokens=40))
    a, b, c = make_req("a", 10, 50), make_req("b", 100, 50), make_req("c", 10, 50)
    reqs = {r.request_id: r for r in (a, b, c)}
    for r in reqs.values():
        sched.add_request(r)
    for _ in range(2):
        plan = sched.schedule()
        sched.update(plan, fake_execute(plan, reqs))
    # a is decoding, b is part-way through its prompt, c is waiting.
    assert a.status is RequestStatus.DECODING and b.status is RequestStatus.PREFILLING
    for rid in ("a", "b", "c"):
        assert sched.finish(rid, FinishReason.ABORT) is not None
    assert all(r.finish_reason is FinishReason.ABORT for r in reqs.values())
    assert kv.check_integrity().used == 0 and not sched.has_work


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(
        st.tuples(st.integers(1, 90), st.integers(1, 30), st.integers(0, 20)), min_size=1, max_size=10
    ),
    num_blocks=st.integers(8, 40),
    budget=st.integers(8, 128),
    max_seqs=st.integers(1, 8),
    prefix_cache=st.booleans(),
)
def test_colocated_property_exact_and_leak_free(
    lens: list[tuple[int, int, int]], num_blocks: int, budget: int, max_seqs: int, prefix_cache: bool
) -> None:
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=prefix_cache)
    sched = ColocatedScheduler(kv, SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs))
    arrivals: dict[int, list[Request]] = {}
    reqs = []
    for i, (n_prompt, n_out, at) in enumerate(lens):
        # Admission control guarantees each request fits the pool alone.
        n_prompt = min(n_prompt, num_blocks * 16 - n_out)
        r = make_req(f"r{i}", n_prompt, n_out, seed=i % 3)  # some identical prompts: prefix hits
        reqs.append(r)
        arrivals.setdefault(at, []).append(r)
    done = run_colocated(sched, arrivals)
    assert len(done) == len(reqs)
    for r in reqs:
        assert r.output_token_ids == expected_output(list(r.prompt_token_ids), len(r.output_token_ids))
        assert len(r.output_token_ids) == r.params.max_tokens
    assert kv.check_integrity().used == 0
