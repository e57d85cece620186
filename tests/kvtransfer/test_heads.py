"""Head slices as data: the wire field's bounds, the handshake's layout check, and which
transfers between caches of different head counts may go ahead (pure, no sockets)."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer import wire
from pdserve.kvtransfer.heads import MAX_KV_HEADS, HeadSlice, for_route, layout_mismatch, transfer_problem
from pdserve.model_runtime.parallel.reshard import routes
from pdserve.model_runtime.parallel.sharding import DEGREES, kv_heads_of

LAYOUT = {
    "num_layers": 6,
    "block_size": 16,
    "num_kv_heads": 2,
    "head_dim": 8,
    "dtype": "torch.float32",
    "order": "block-major",
}


def begin(**extra: object) -> dict[str, object]:
    frame = wire.encode("begin", id="t", dst_blocks=[1, 2], num_layers=6, layerwise=False, **extra)
    return wire.decode_body(frame[4:])


def test_the_begin_frame_carries_an_optional_slice() -> None:
    assert "heads" not in begin()  # no slice: the frame is what it always was
    assert begin(heads=[1, 0, 2])["heads"] == [1, 0, 2]
    assert HeadSlice.from_wire(begin(heads=[1, 0, 2])["heads"]) == HeadSlice(1, 0, 2)
    data = wire.encode("data", id="t", layer=0, first=0, count=2, heads=3)
    assert wire.decode_body(data[4:])["heads"] == 3


@pytest.mark.parametrize(
    "heads,match",
    [
        ([0, 0, 0], "outside"),  # no heads
        ([0, 0], "src_start, dst_start, count"),
        ([0, 0, 1, 1], "heads"),
        ([MAX_KV_HEADS, 0, 1], "outside"),
        ([0, MAX_KV_HEADS - 1, 2], "outside"),
        ([-1, 0, 1], "non-negative"),
        (["0", 0, 1], "non-negative"),
        (5, "expected a list"),
    ],
)
def test_malformed_slices_are_frame_errors(heads: object, match: str) -> None:
    msg = {"v": 1, "t": "begin", "id": "x", "dst_blocks": [1], "num_layers": 4, "layerwise": True}
    with pytest.raises(wire.FrameError, match=match):
        wire.validate(msg | {"heads": heads})


def test_a_data_frame_names_at_least_one_head() -> None:
    with pytest.raises(wire.FrameError, match="outside"):
        wire.validate({"v": 1, "t": "data", "id": "x", "layer": 0, "first": 0, "count": 1, "heads": 0})


def test_head_slice_values_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one head"):
        HeadSlice(0, 0, 0)
    with pytest.raises(ValueError, match="src_start"):
        HeadSlice(-1, 0, 1)
    with pytest.raises(ValueError, match="dst_start"):
        HeadSlice(0, True, 1)  # type: ignore[arg-type]
    assert HeadSlice(1, 0, 2).same_destination(HeadSlice(0, 0, 2))
    assert not HeadSlice(0, 0, 2).same_destination(HeadSlice(0, 1, 2))


def test_layouts_may_differ_in_head_count_only() -> None:
    assert layout_mismatch(LAYOUT, LAYOUT) is None
    assert layout_mismatch(LAYOUT, LAYOUT | {"num_kv_heads": 4}) is None  # another TP degree
    for field, value in (("head_dim", 16), ("block_size", 8), ("dtype", "torch.float16"), ("num_layers", 5)):
        problem = layout_mismatch(LAYOUT, LAYOUT | {field: value})
        assert problem is not None and field in problem
    assert layout_mismatch(LAYOUT, LAYOUT | {"order": "layer-major"}) is not None
    assert layout_mismatch(LAYOUT, LAYOUT | {"num_kv_heads": 0}) is not None
    assert layout_mismatch(LAYOUT, LAYOUT | {"num_kv_heads": "2"}) is not None
    assert layout_mismatch(LAYOUT, LAYOUT | {"extra": 1}) is not None


def test_which_transfers_may_go_ahead() -> None:
    assert transfer_problem(None, 2, 2) is None  # whole blocks between equal caches
    assert "must name a head slice" in str(transfer_problem(None, 4, 2))
    assert transfer_problem(HeadSlice(2, 0, 2), 4, 2) is None
    assert transfer_problem(HeadSlice(0, 1, 1), 1, 2) is None
    assert "reads past the sender's 4" in str(transfer_problem(HeadSlice(3, 0, 2), 4, 2))
    assert "writes past the receiver's 2" in str(transfer_problem(HeadSlice(0, 1, 2), 4, 2))


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_every_reshard_route_names_a_slice_both_ranks_take(num_kv_heads: int) -> None:
    """The plan's routes, as transfers: each one's slice fits both ranks' caches, and equal
    degrees move whole blocks (no slice, today's path)."""
    for p in DEGREES:
        for d in DEGREES:
            for r in routes(num_kv_heads, p, d):
                src_heads = kv_heads_of(num_kv_heads, p, r.src_rank)[1]
                dst_heads = kv_heads_of(num_kv_heads, d, r.dst_rank)[1]
                heads = for_route(r, src_heads, dst_heads)
                assert transfer_problem(heads, src_heads, dst_heads) is None, (p, d, r)
                assert (heads is None) == (src_heads == dst_heads == r.count), (p, d, r)
                if p == d:
                    assert heads is None
