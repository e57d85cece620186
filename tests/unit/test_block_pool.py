from __future__ import annotations

import copy

import pytest

from pdserve.model_runtime.kv_cache.block_pool import BlockPool, IntegrityError, chain_key, prefix_block_keys


def test_allocate_free_and_counts() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 5
    pool.touch(a[:1])
    assert pool.ref_count(a[0]) == 2
    pool.check_integrity({"r1": a, "r2": a[:1]})
    pool.free(a)
    pool.free(a[:1])
    assert pool.num_free_blocks == 8
    stats = pool.check_integrity({})
    assert (stats.free, stats.cached, stats.used) == (8, 0, 0)


def test_allocate_beyond_capacity_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_double_free_is_an_integrity_error() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(IntegrityError):
        pool.free([b])


def test_chain_keys_cover_the_whole_prefix() -> None:
    k1 = prefix_block_keys([1, 2, 3, 4], 2)
    k2 = prefix_block_keys([9, 9, 3, 4], 2)
    assert len(k1) == 2 and k1[1] != k2[1]  # same block tokens, different parents
    assert k1 == prefix_block_keys([1, 2, 3, 4, 5], 2)  # partial tail block has no key
    assert chain_key(None, [1, 2]) == k1[0]


def test_hit_compares_token_ids_not_just_the_key() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    key = chain_key(None, [1, 2])
    pool.cache(b, key, [1, 2])
    assert pool.lookup(key, [1, 2]) == b
    assert pool.lookup(key, [1, 3]) is None  # a colliding key with other tokens is a miss


def test_cached_blocks_are_reused_lru_and_evicted_last() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    keys = [chain_key(None, [i]) for i in range(3)]
    for b, k, t in zip(blocks, keys, range(3), strict=True):
        pool.cache(b, k, [t])
    pool.free([blocks[2], blocks[1], blocks[0]])  # freed tail first
    assert pool.stats().cached == 3
    # Reviving a cached block takes it out of the free queue and keeps its key.
    pool.touch([blocks[0]])
    assert pool.lookup(keys[0], [0]) == blocks[0]
    # The next allocation evicts the least recently freed cached block (blocks[2]).
    (new,) = pool.allocate(1)
    assert new == blocks[2]
    assert pool.lookup(keys[2], [2]) is None
    assert pool.lookup(keys[1], [1]) == blocks[1]
    pool.check_integrity({"a": [blocks[0]], "b": [new]})


def test_duplicate_publication_keeps_first_writer() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    key = chain_key(None, [7])
    pool.cache(a, key, [7])
    pool.cache(b, key, [7])
    assert pool.lookup(key, [7]) == a
    pool.free([a, b])
    assert pool.stats().cached == 1
    pool.check_integrity({})


def test_integrity_detects_wrong_owner_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    with pytest.raises(IntegrityError):
        pool.check_integrity({"r": a[:1]})


def test_prefix_caching_disabled_never_hits() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    (b,) = pool.allocate(1)
    key = chain_key(None, [1])
    pool.cache(b, key, [1])
    assert pool.lookup(key, [1]) is None


def test_cached_among_next_is_what_allocating_that_many_does_to_the_cached_count() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    for i, b in enumerate(blocks[:4]):
        pool.cache(b, chain_key(None, [i]), [i])
    pool.free([blocks[4], blocks[0], blocks[5], blocks[1], blocks[2], blocks[3]])  # queue order
    for n in range(7):
        before = pool.stats().cached
        expected = pool.cached_among_next(n)
        trial = copy.deepcopy(pool)
        trial.allocate(n)
        assert before - trial.stats().cached == expected
    assert [pool.cached_among_next(n) for n in range(7)] == [0, 0, 1, 1, 2, 3, 4]
