"""Sharding and re-sharding decisions: every head lands once on the ranks that keep it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.model_runtime.parallel.reshard import routes, routes_to
from pdserve.model_runtime.parallel.sharding import (
    ModelShape,
    ShardingError,
    check_degree,
    kv_heads_of,
    shard,
    valid_degrees,
)

SMOLLM2 = ModelShape(num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152)
LLAMA70B = ModelShape(num_heads=64, num_kv_heads=8, intermediate_size=28672, vocab_size=128256)


def test_valid_degrees_name_what_a_model_allows() -> None:
    assert valid_degrees(LLAMA70B) == (1, 2, 4, 8)
    assert valid_degrees(SMOLLM2) == (1,)  # 9 heads: only TP 3 would split, not a power of two
    with pytest.raises(ShardingError, match=r"valid degrees: 1$"):
        check_degree(SMOLLM2, 2)
    with pytest.raises(ShardingError, match="must be >= 1"):
        check_degree(LLAMA70B, 0)


def test_fewer_kv_heads_than_ranks_replicates_each_head_on_its_query_ranks() -> None:
    shape = ModelShape(num_heads=8, num_kv_heads=2, intermediate_size=64, vocab_size=100)
    shards = [shard(shape, 4, r) for r in range(4)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    group = shape.num_heads // shape.num_kv_heads
    for s in shards:  # a rank's query heads all read the KV head it holds
        first, n = s.q_heads
        assert {h // group for h in range(first, first + n)} == {s.kv_heads[0]}


def test_vocabulary_shards_cover_it_once_with_padding_on_the_last() -> None:
    shape = ModelShape(num_heads=4, num_kv_heads=4, intermediate_size=8, vocab_size=10)
    shards = [shard(shape, 4, r) for r in range(4)]
    assert [s.vocab for s in shards] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert {s.vocab_rows for s in shards} == {3}


DEG = st.sampled_from([1, 2, 4, 8])


@given(kv=st.sampled_from([1, 2, 4, 8]), p=DEG, d=DEG)
def test_every_decode_rank_gets_exactly_its_heads_once(kv: int, p: int, d: int) -> None:
    rs = routes(kv, p, d)
    for dst in range(d):
        first, count = kv_heads_of(kv, d, dst)
        got = []
        for r in routes_to(kv, p, d, dst):
            s_first, s_count = kv_heads_of(kv, p, r.src_rank)
            assert r.src_head >= 0 and r.src_head + r.count <= s_count  # the source holds them
            assert [s_first + r.src_head + i for i in range(r.count)] == [
                first + r.dst_head + i for i in range(r.count)
            ]  # the same global heads on both sides
            got += [first + r.dst_head + i for i in range(r.count)]
        assert sorted(got) == list(range(first, first + count))  # each once, nothing else
    # A route per (source, destination) pair at most, and no more pairs than the larger degree.
    assert len({(r.src_rank, r.dst_rank) for r in rs}) == len(rs) <= max(p, d)


def test_replicated_sources_are_spread_over_receivers() -> None:
    # 2 KV heads at prefill TP 8: head 0 on ranks 0-3, head 1 on 4-7; decode TP 2 wants one each.
    assert [(r.src_rank, r.dst_rank) for r in routes(2, 8, 2)] == [(0, 0), (5, 1)]
    # decode TP 4 over 2 heads: ranks 0, 1 need head 0 from distinct replicas of prefill TP 4.
    assert [(r.src_rank, r.dst_rank) for r in routes(2, 4, 4)] == [(0, 0), (1, 1), (2, 2), (3, 3)]
