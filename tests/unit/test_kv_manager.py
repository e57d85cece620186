from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams

NO_REQUEST_STATE = {"kv_tables": 0, "kv_keys": 0, "kv_published": 0, "kv_views": 0, "kv_retired": 0}


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tuple(tokens), SamplingParams())


def test_allocate_slots_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    assert len(kv.block_table("a")) == 3
    b = req("b", list(range(8)))
    assert not kv.allocate_slots(b, 8)
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    kv.check_integrity()
    kv.free("a")
    assert kv.num_free_blocks == 4
    kv.check_integrity()


def test_prefix_hit_leaves_at_least_one_token_and_shares_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    # Same 8 tokens: only the first block may hit, so one token is left to compute.
    b = req("b", list(range(8)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and hits == kv.block_table("a")[:1]
    # A longer prompt sharing the prefix hits both blocks.
    c = req("c", [*range(8), 99])
    hits_c, n_c = kv.get_computed_blocks(c)
    assert n_c == 8 and hits_c == kv.block_table("a")
    assert kv.allocate_slots(c, 1, hits_c)
    c.num_computed_tokens = 8
    assert kv.block_table("c")[:2] == kv.block_table("a")
    assert kv.pool.ref_count(hits_c[0]) == 2
    kv.check_integrity()
    kv.free("a")
    kv.free("c")
    stats = kv.check_integrity()
    assert stats.used == 0 and stats.cached == 2


def test_only_fully_computed_blocks_are_published() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 6  # a chunk boundary inside block 1
    kv.cache_computed_blocks(a)
    b = req("b", [*range(10), 5])
    _, n = kv.get_computed_blocks(b)
    assert n == 4
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    _, n = kv.get_computed_blocks(b)
    assert n == 8


def test_reused_request_id_cannot_publish_stale_keys() -> None:
    """A request only looked at (allocation failed, then aborted while queued) leaves no keys: a
    later request re-using its id with another prompt must publish its blocks under its own
    keys, or a third request sharing the first prompt would hit KV computed in another context."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = [1, 2, 3, 4]
    shared = [5, 6, 7, 8]
    d = req("d", [*first, 99])
    assert kv.allocate_slots(d, 5)
    d.num_computed_tokens = 5
    kv.cache_computed_blocks(d)
    kv.free("d")  # its first block stays cached under the key of [1, 2, 3, 4]

    looked_at = req("r", [*first, *shared, 9])
    kv.get_computed_blocks(looked_at)  # then the request is aborted while still queued
    assert kv.request_state() == NO_REQUEST_STATE

    reused = req("r", [11, 12, 13, 14, *shared, 9])
    hits, _ = kv.get_computed_blocks(reused)
    assert hits == []
    assert kv.allocate_slots(reused, 9)
    reused.num_computed_tokens = 9
    kv.cache_computed_blocks(reused)
    kv.free("r")

    victim = req("c", [*first, *shared, 9])
    hits, tokens = kv.get_computed_blocks(victim)
    assert tokens == 4, "the second block's KV was computed after [11, 12, 13, 14], not [1, 2, 3, 4]"
    kv.check_integrity()
    assert kv.request_state() == NO_REQUEST_STATE


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9), st.booleans()), max_size=60))
def test_block_table_view_always_equals_the_table(ops: list[tuple[int, int, bool]]) -> None:
    """The cached tuple view is the live table after any sequence of allocations (decode steps
    inside a block, across a boundary, refused ones) and frees, and goes with the request."""
    kv = KVCacheManager(num_blocks=12, block_size=4)
    reqs = {i: req(f"r{i}", list(range(3 + i))) for i in range(3)}
    for i, n, free in ops:
        r = reqs[i]
        if free:
            kv.free(r.request_id)
            r.num_computed_tokens = 0
        elif kv.allocate_slots(r, n):
            r.num_computed_tokens += n
        for other in reqs.values():
            assert kv.block_table_view(other.request_id) == tuple(kv.block_table(other.request_id))
        kv.check_integrity()
    for r in reqs.values():
        kv.free(r.request_id)
    assert not any(kv.request_state().values())


def test_retired_blocks_stay_out_of_the_pool_until_released_and_the_id_is_free_at_once() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(1, 10)))
    assert kv.allocate_slots(a, 9)
    blocks = kv.block_table("a")
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    handle = kv.retire("a")
    assert handle is not None and not kv.holds("a")
    assert kv.num_free_blocks == 1 and kv.request_state()["kv_retired"] == 1
    again = req("a", [50, 51, 52, 53, 54])  # the same id, another request: its own blocks
    assert kv.allocate_slots(again, 1) and not set(kv.block_table("a")) & set(blocks)
    assert not kv.allocate_slots(req("b", [1, 2, 3, 4, 5]), 5)  # the retired ones are not free
    kv.check_integrity()
    kv.release(handle)
    kv.free("a")
    assert kv.stats().used == 0 and kv.request_state()["kv_retired"] == 0
    kv.check_integrity()
    assert kv.retire("nobody") is None


@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30), st.integers(0, 3)), min_size=1, max_size=25),
    st.sampled_from([2, 4]),
)
def test_known_prompt_keys_change_no_hit_and_no_key(ops: list[tuple[int, int, int]], bs: int) -> None:
    """A manager handed the prompts' block keys (``prompt_keys``) and blocks (``prompt_blocks``)
    looks up, caches and evicts exactly as one that hashes and slices them itself: the same
    hits, tables and keys."""
    from pdserve.router.prefix import block_keys
    from pdserve.simulator.prompt_memo import prompt_blocks

    asked: list[tuple[int, ...]] = []
    cut: list[tuple[int, ...]] = []

    def known(prompt: tuple[int, ...]) -> tuple[bytes, ...]:
        asked.append(prompt)
        return block_keys(prompt, bs)

    def blocks(prompt: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        cut.append(prompt)
        return prompt_blocks(prompt, bs)

    plain = KVCacheManager(12, bs)
    given_keys = KVCacheManager(12, bs, prompt_keys=known, prompt_blocks=blocks)
    prefixes = [list(range(40)), [7] * 40, list(range(40, 0, -1))]
    held: list[str] = []
    for i, (p, n, extra) in enumerate(ops):
        r1 = req(f"r{i}", prefixes[p][:n] + [99] * extra)
        r2 = req(f"r{i}", prefixes[p][:n] + [99] * extra)
        got = [kv.get_computed_blocks(r) for kv, r in ((plain, r1), (given_keys, r2))]
        assert got[0] == got[1]
        hits, tokens = got[0]
        ok = [
            kv.allocate_slots(r, r.num_tokens - tokens, h)
            for kv, r, h in ((plain, r1, hits), (given_keys, r2, got[1][0]))
        ]
        assert ok[0] == ok[1]
        if ok[0]:
            for kv, r in ((plain, r1), (given_keys, r2)):
                r.num_computed_tokens = r.num_tokens
                kv.cache_computed_blocks(r)
            assert plain.block_table(r1.request_id) == given_keys.block_table(r2.request_id)
            mine = plain._keys.get(r1.request_id, [])
            assert mine == given_keys._keys.get(r2.request_id, [])[: len(mine)]
            held.append(r1.request_id)
        if len(held) > 2:
            gone = held.pop(0)
            plain.free(gone)
            given_keys.free(gone)
        assert plain.stats() == given_keys.stats()
    plain.check_integrity()
    given_keys.check_integrity()
    assert asked and cut  # the keys and blocks came from the providers
    assert plain.pool._tokens == given_keys.pool._tokens  # the same blocks stored for each key


def test_a_lookup_hashes_blocks_only_up_to_the_first_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt no cache holds costs one block key to look up, not one a block."""
    from pdserve.model_runtime.kv_cache import manager

    calls = {"n": 0}
    real = manager.chain_key

    def counted(parent: bytes | None, tokens: object) -> bytes:
        calls["n"] += 1
        return real(parent, tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(manager, "chain_key", counted)
    kv = KVCacheManager(num_blocks=64, block_size=4)
    assert kv.get_computed_blocks(req("a", list(range(200)))) == ([], 0)
    assert calls["n"] == 1
