"""A worker's prefix-cache events (the block pool's log) and the router's index built from them:
in order, exact after any sequence of pool operations, bounded when nobody takes them, and a
fresh index fed a snapshot agrees with one that heard every op."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model_runtime.kv_cache.block_pool import BlockPool, chain_key
from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.router.prefix import PrefixIndex, block_keys
from pdserve.worker import kv_events
from pdserve.worker.kv_events import KvEventLog
from pdserve.worker.messages import KvEvents


def key(i: int) -> bytes:
    return chain_key(None, [i])


def watched(num_blocks: int) -> tuple[BlockPool, KvEventLog]:
    pool = BlockPool(num_blocks)
    log = KvEventLog(num_blocks)
    pool.listen(log)
    return pool, log


def test_ops_come_in_the_order_the_pool_made_them() -> None:
    pool, log = watched(2)
    a, b = pool.allocate(2)
    pool.cache(a, key(1), [1])
    pool.cache(b, key(2), [2])
    pool.cache(b, key(3), [3])  # a block already published keeps its key: no event
    pool.free([a, b])
    assert log.take() == KvEvents(((True, key(1)), (True, key(2))))
    assert log.take() is None  # each op is taken once
    (c,) = pool.allocate(1)  # reuses the least recently freed block: evicts key(1)
    pool.cache(c, key(4), [4])
    pool.free([c])
    pool.reset_prefix_cache()
    ops = log.take()
    assert ops is not None and ops.snapshot is None
    assert ops.ops[:2] == ((False, key(1)), (True, key(4)))
    assert len(ops.ops) == 4 and set(ops.ops[2:]) == {(False, key(2)), (False, key(4))}
    assert log.snapshot() == KvEvents((), ())


def test_a_listener_added_late_hears_the_keys_already_cached() -> None:
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache(a, key(1), [1])
    log = KvEventLog(4)
    pool.listen(log)
    assert log.snapshot().snapshot == (key(1),)


def test_a_log_nobody_takes_stays_bounded_and_turns_into_a_snapshot() -> None:
    pool, log = watched(8)
    assert log.max_ops == kv_events.MIN_LOG_OPS
    for i in range(3 * log.max_ops):  # publish and evict, over and over, with nobody taking
        (b,) = pool.allocate(1)
        pool.cache(b, key(i), [i])
        pool.free([b])
        assert len(log._ops) <= log.max_ops
    assert log.overflows == 1
    taken = log.take()
    assert taken is not None and taken.ops == ()
    assert taken.snapshot is not None and set(taken.snapshot) == set(pool.cached_keys())
    assert len(taken.snapshot) == 8
    (b,) = pool.allocate(1)  # from here on, ops again
    assert log.take() == KvEvents(((False, taken.snapshot[0]),))  # the oldest key goes first


def test_a_snapshot_keeps_the_newest_keys_past_its_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "MAX_SNAPSHOT_KEYS", 3)
    pool, log = watched(5)
    blocks = pool.allocate(5)
    for i, b in enumerate(blocks):
        pool.cache(b, key(i), [i])
    assert log.snapshot().snapshot == (key(2), key(3), key(4))


def test_the_routers_view_follows_a_kv_manager_serving_requests() -> None:
    """What the engines do (allocate, publish computed blocks, free, evict under pressure), seen
    through the events: the index holds exactly the pool's keys, and a prompt's prefix."""
    kv = KVCacheManager(12, block_size=4)
    log = KvEventLog(kv.num_blocks)
    kv.pool.listen(log)
    idx = PrefixIndex(4, hint_s=0.0)
    params = SamplingParams(max_tokens=1)
    for n, prompt in enumerate([tuple(range(20)), tuple(range(12)) + (99,) * 8, tuple(range(100, 140))]):
        req = Request(f"r{n}", prompt, params)
        computed, hit = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, len(prompt) - hit, computed)
        req.num_computed_tokens = len(prompt)
        kv.cache_computed_blocks(req)
        kv.free(req.request_id)
        events = log.take()
        assert events is not None
        idx.apply("w", events)
        assert idx.holds("w") == set(kv.pool.cached_keys())
    last = block_keys(tuple(range(100, 140)), 4)
    assert idx.cached_blocks("w", last, now=0.0) == 10
    assert len(kv.pool.cached_keys()) == 12 and kv.pool.num_evictions == 5  # the first two lost 5


# One pool operation: (kind, argument). Allocation takes blocks, caching publishes one held block
# under a key drawn from a small space (so keys repeat and collide), freeing returns held blocks.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 4)),
        st.tuples(st.just("cache"), st.integers(0, 40)),
        st.tuples(st.just("free"), st.integers(1, 4)),
        st.tuples(st.just("take"), st.integers(0, 1)),  # 1: a fresh router joins (a snapshot)
        st.tuples(st.just("reset"), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_after_any_pool_operations_every_router_holds_the_pools_keys(ops: list[tuple[str, int]]) -> None:
    pool, log = watched(6)
    first = PrefixIndex(16, hint_s=0.0)  # heard every take from the start
    first.apply("w", log.snapshot())
    late: PrefixIndex | None = None  # joined later: a snapshot (after a take), then every take
    held: list[int] = []
    for kind, arg in ops:
        if kind == "alloc" and pool.num_free_blocks >= arg:
            held.extend(pool.allocate(arg))
        elif kind == "cache" and held:
            pool.cache(held[arg % len(held)], key(arg), [arg])
        elif kind == "free" and held:
            pool.free(held[-arg:])
            del held[-arg:]
        elif kind == "reset":
            pool.reset_prefix_cache()
        elif kind == "take":
            taken = log.take()
            for idx in (first, late):
                if idx is not None and taken is not None:
                    idx.apply("w", taken)
            if arg:
                late = PrefixIndex(16, hint_s=0.0)
                late.apply("w", log.snapshot())
    taken = log.take()
    truth = set(pool.cached_keys())
    for idx in (first, late):
        if idx is not None:
            if taken is not None:
                idx.apply("w", taken)
            assert idx.holds("w") == truth


def test_ops_and_snapshots_from_another_thread_stay_consistent() -> None:
    """The engine's thread publishes and evicts while the channel's thread takes and, now and
    then, starts a new view from a snapshot: every view ends equal to the pool's keys."""
    pool, log = watched(64)
    views = [PrefixIndex(16, hint_s=0.0)]
    views[0].apply("w", log.snapshot())
    done = threading.Event()

    def engine() -> None:
        for i in range(20_000):
            (b,) = pool.allocate(1)
            pool.cache(b, key(i % 500), [i % 500])
            pool.free([b])
        done.set()

    t = threading.Thread(target=engine)
    t.start()
    n = 0
    while not done.is_set():
        taken = log.take()
        if taken is not None:
            for v in views:
                v.apply("w", taken)
        n += 1
        if n % 50 == 0:
            fresh = PrefixIndex(16, hint_s=0.0)
            fresh.apply("w", log.snapshot())
            views.append(fresh)
    t.join()
    taken = log.take()
    truth = set(pool.cached_keys())
    for v in views:
        if taken is not None:
            v.apply("w", taken)
        assert v.holds("w") == truth
