"""Transfers between caches of different KV head counts (tensor-parallel ranks of workers of
different degrees): only the named head slice moves, byte for byte, every other head and block
of the receiver stays as it was, and the counters show exactly the slice's bytes and one copy
per layer and run of blocks."""

from __future__ import annotations

import pytest
import torch

from pdserve.kvtransfer import wire
from pdserve.kvtransfer.directwrite import CudaIpcPath
from pdserve.kvtransfer.heads import HeadSlice
from pdserve.kvtransfer.slices import direct_pairs, head_bytes, pack, unpack
from pdserve.kvtransfer.states import FailureCause, TransferState
from pdserve.kvtransfer.transport import KVTransport, layout_of
from pdserve.model_runtime.kv_cache.tensors import new_kv_cache
from tests.kvtransfer.helpers import raw_client, transport
from tests.kvtransfer.test_faults import outcome

LAYERS, BLOCK, DIM = 3, 4, 8


def shape(heads: int, blocks: int) -> tuple[int, ...]:
    return (LAYERS, blocks, 2, BLOCK, heads, DIM)


SENTINEL = -7.0
# Non-contiguous on both sides, three runs where both lists advance together.
SRC = [0, 1, 2, 5, 6, 9]
DST = [3, 4, 5, 0, 1, 7]
RUNS = 3
CASES = {
    "4to2": (4, 2, HeadSlice(2, 0, 2)),  # a degree-1 prefill rank feeds the second of two decode ranks
    "1to2": (1, 2, HeadSlice(0, 1, 1)),  # a degree-2 prefill rank feeds the second head of a degree-1 rank
}


def receiver_with_sentinel(backend: str, heads: int) -> KVTransport:
    rx = transport(backend, shape=shape(heads, 10))  # fewer blocks than the sender, too
    rx.cache.fill_(SENTINEL)
    return rx


def expected(src: torch.Tensor, dst_shape: tuple[int, ...], heads: HeadSlice) -> torch.Tensor:
    out = torch.full(dst_shape, SENTINEL)
    s, d, c = heads.src_start, heads.dst_start, heads.count
    for sb, db in zip(SRC, DST, strict=True):
        out[:, db, :, :, d : d + c] = src[:, sb, :, :, s : s + c]
    return out


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_only_the_slice_moves(backend: str, case: str, layerwise: bool) -> None:
    src_heads, dst_heads, heads = CASES[case]
    sender = transport(backend, seed=5, shape=shape(src_heads, 12))
    receiver = receiver_with_sentinel(backend, dst_heads)
    try:
        receiver.listen()
        receiver.expect("s", DST, heads=heads)
        sender.send("s", receiver.address, SRC, DST, layerwise=layerwise, heads=heads)
        if layerwise:
            for layer in range(LAYERS):
                sender.layer_ready("s", layer)
        assert outcome(sender, "s") == "sent"
        assert outcome(receiver, "s") == "received"
        assert torch.equal(receiver.cache, expected(sender.cache, tuple(receiver.cache.shape), heads))
        whole = LAYERS * len(DST) * receiver.cache[0, 0].numel() * 4  # the blocks' every head
        assert receiver.stats.received_by_backend[backend] * dst_heads == whole * heads.count
        assert sender.stats.sent_by_backend[backend] == receiver.stats.bytes_received
        # One copy per layer and run: tcp packs on the sender and scatters on the receiver,
        # except on a side whose every head the slice is (its blocks go out, or come in, as
        # they are); shm copies once, on the sender, straight into the receiver's cache.
        tcp = backend == "tcp"
        packs = not (tcp and heads.count == src_heads)
        scatters = tcp and heads.count != dst_heads
        assert sender.stats.descriptors_sent_by_backend[backend] == (LAYERS * RUNS if packs else 0)
        assert receiver.stats.descriptors_received == (LAYERS * RUNS if scatters else 0)
    finally:
        sender.close()
        receiver.close()


def test_equal_heads_without_a_slice_count_no_copies() -> None:
    sender, receiver = transport("tcp", seed=6), transport("tcp")
    try:
        receiver.listen()
        receiver.expect("w", [1, 2])
        sender.send("w", receiver.address, [3, 4], [1, 2])
        assert outcome(receiver, "w") == "received"
        assert torch.equal(receiver.cache[:, [1, 2]], sender.cache[:, [3, 4]])
        assert receiver.stats.bytes_received == 2 * block_bytes(sender)
        assert sender.stats.descriptors_sent == receiver.stats.descriptors_received == 0
    finally:
        sender.close()
        receiver.close()


def block_bytes(t: KVTransport) -> int:
    """Bytes of one block across every layer."""
    return int(t.cache[:, 0].numel() * t.cache.element_size())


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_transfer_between_different_heads_needs_a_slice(backend: str) -> None:
    sender = transport(backend, seed=7, shape=shape(4, 12))
    receiver = receiver_with_sentinel(backend, 2)
    try:
        receiver.listen()
        receiver.expect("n", DST)
        sender.send("n", receiver.address, SRC, DST)  # whole blocks into half-size blocks
        assert outcome(sender, "n") is FailureCause.LAYOUT_MISMATCH
        assert receiver.state("n") is TransferState.BOOTSTRAPPING  # no begin reached it
        assert bool((receiver.cache == SENTINEL).all())
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_slice_other_than_the_expected_one_is_refused(backend: str) -> None:
    sender = transport(backend, seed=8, shape=shape(4, 12))
    receiver = receiver_with_sentinel(backend, 2)
    try:
        receiver.listen()
        receiver.expect("m", DST, heads=HeadSlice(2, 0, 2))
        sender.send("m", receiver.address, SRC, DST, heads=HeadSlice(0, 1, 1))
        assert outcome(sender, "m") is FailureCause.REJECTED
        assert outcome(receiver, "m") is FailureCause.REJECTED
        assert bool((receiver.cache == SENTINEL).all())
    finally:
        sender.close()
        receiver.close()


def test_slices_outside_either_cache_are_refused_by_the_owner_api() -> None:
    sender = transport("tcp", seed=9, shape=shape(1, 12))
    receiver = transport("tcp", shape=shape(2, 10))
    try:
        with pytest.raises(ValueError, match="outside this cache's 1 KV heads"):
            sender.send("o", "127.0.0.1:1", SRC, DST, heads=HeadSlice(1, 0, 1))
        with pytest.raises(ValueError, match="outside this cache's 2 KV heads"):
            receiver.expect("o", DST, heads=HeadSlice(0, 1, 2))
        receiver.listen()
        receiver.expect("o", DST)
        sender.send("o", receiver.address, SRC, DST, heads=HeadSlice(0, 2, 1))  # past its heads
        assert outcome(sender, "o") is FailureCause.LAYOUT_MISMATCH
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(
    "heads,expect,cause",
    [
        (None, None, "layout_mismatch"),  # 4 heads into 2 without a slice
        ([0, 1, 2], None, "layout_mismatch"),  # past the receiver's heads
        ([3, 0, 2], None, "layout_mismatch"),  # past the sender's heads
        ([0, 0, 2], HeadSlice(2, 0, 1), "rejected"),  # not the expected slice
        ([0, 0, 2], None, "rejected"),  # a slice where whole blocks were expected
    ],
)
def test_the_receiver_checks_each_begin(
    heads: list[int] | None, expect: HeadSlice | None, cause: str
) -> None:
    """What a sender that skipped its own checks gets: a reject with the cause, no write."""
    receiver = transport("tcp", shape=shape(2, 10))
    try:
        receiver.listen()
        receiver.expect("r", [1, 2], heads=expect)
        layout = layout_of(new_kv_cache(shape(4, 12), torch.float32))
        conn = raw_client(receiver.address, layout=layout)
        assert wire.HEAD_SLICE in conn.info["features"] and conn.info["layout"]["num_kv_heads"] == 2
        sliced = {} if heads is None else {"heads": heads}
        conn.send("begin", id="r", dst_blocks=[1, 2], num_layers=LAYERS, layerwise=False, **sliced)
        answer = conn.read_frame()
        assert answer["t"] == "reject" and answer["cause"] == cause, answer
        assert outcome(receiver, "r") is FailureCause(cause)
        conn.close()
    finally:
        receiver.close()


def test_a_data_frame_must_carry_the_slice_of_its_begin() -> None:
    receiver = transport("tcp", shape=shape(2, 10))
    try:
        receiver.listen()
        receiver.expect("d", [1], heads=HeadSlice(0, 0, 2))
        conn = raw_client(receiver.address, layout=layout_of(new_kv_cache(shape(4, 12), torch.float32)))
        conn.send("begin", id="d", dst_blocks=[1], num_layers=LAYERS, layerwise=False, heads=[2, 0, 2])
        assert conn.read_frame()["t"] == "ready"
        conn.send("data", id="d", layer=0, first=0, count=1)  # whole-block payload: refused
        assert outcome(receiver, "d") is FailureCause.PEER_LOST  # the connection was dropped
        conn.close()
    finally:
        receiver.close()


def test_pack_and_unpack_are_one_copy_per_run_on_tensors() -> None:
    """The torch side of the helpers, as the GPU paths (nccl, cuda_ipc) use them."""
    src = head_bytes(new_kv_cache(shape(4, 12), torch.float32).normal_())
    dst = head_bytes(new_kv_cache(shape(2, 10), torch.float32))
    staging = torch.empty((len(SRC), 2, BLOCK, 2, DIM * 4), dtype=torch.uint8)
    copies: list[tuple[torch.Size, torch.Size]] = []

    def copy(d: torch.Tensor, s: torch.Tensor) -> None:
        copies.append((d.shape, s.shape))
        d.copy_(s)

    assert pack(src, staging, 1, SRC, 2, copy) == RUNS
    assert unpack(staging, dst, 1, DST, 0, copy) == RUNS
    assert len(copies) == 2 * RUNS
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(dst[1, d, :, :, 0:2], src[1, s, :, :, 2:4])
    assert not dst[0].any() and not dst[2].any()
    pairs = direct_pairs(src, dst, range(LAYERS), SRC, DST, HeadSlice(3, 1, 1))
    assert len(pairs) == LAYERS * RUNS
    torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    assert all(torch.equal(dst[:, d, :, :, 1], src[:, s, :, :, 3]) for s, d in zip(SRC, DST, strict=True))


def test_an_ignored_sliced_data_frame_is_drained_by_its_own_size() -> None:
    """A cancelled transfer's late data frame is skipped by the slice's bytes, not a whole
    block's, so the next transfer on the connection reads in step."""
    receiver = transport("tcp", shape=shape(2, 10))
    layout = layout_of(new_kv_cache(shape(4, 12), torch.float32))
    one = torch.arange(2 * BLOCK * DIM, dtype=torch.float32).reshape(1, 2, BLOCK, 1, DIM)
    try:
        receiver.listen()
        receiver.expect("a", [1], heads=HeadSlice(3, 1, 1))
        receiver.expect("b", [2], heads=HeadSlice(3, 1, 1))
        conn = raw_client(receiver.address, layout=layout)
        conn.send("begin", id="a", dst_blocks=[1], num_layers=LAYERS, layerwise=False, heads=[3, 1, 1])
        assert conn.read_frame()["t"] == "ready"
        receiver.cancel("a")
        assert conn.read_frame()["t"] == "abort"
        conn.send("data", [one.numpy()], id="a", layer=0, first=0, count=1, heads=1)  # ignored
        conn.send("begin", id="b", dst_blocks=[2], num_layers=LAYERS, layerwise=False, heads=[3, 1, 1])
        assert conn.read_frame()["t"] == "ready"
        for layer in range(LAYERS):
            end = layer == LAYERS - 1
            conn.send("data", [one.numpy()], id="b", layer=layer, first=0, count=1, heads=1, done=end)
        assert outcome(receiver, "b") == "received"
        assert torch.equal(receiver.cache[:, 2, :, :, 1], one[0, :, :, 0].expand(LAYERS, -1, -1, -1))
        assert not receiver.cache[:, 2, :, :, 0].any() and not receiver.cache[:, 1].any()
        assert receiver.stats.bytes_received == LAYERS * one.numel() * 4
        conn.close()
    finally:
        receiver.close()


def test_cuda_ipc_slice_copy_on_cpu_tensors() -> None:
    """``CudaIpcPath``'s slice copy, run on CPU tensors (its CUDA set-up skipped): the copies it
    issues, one per layer and run, land exactly the slice."""
    local = new_kv_cache(shape(4, 12), torch.float32).normal_()
    peer = torch.full(shape(2, 10), SENTINEL)
    path = CudaIpcPath.__new__(CudaIpcPath)  # no stream, no IPC handle: only the copy is under test
    path._local_heads = head_bytes(local)
    conn = object()
    path._peer_caches = {id(conn): peer}
    heads = HeadSlice(1, 0, 2)
    assert path._copy_slice(conn, range(1, LAYERS), SRC, DST, heads) == (LAYERS - 1) * RUNS  # type: ignore[arg-type]
    want = torch.full(shape(2, 10), SENTINEL)
    for s, d in zip(SRC, DST, strict=True):
        want[1:, d, :, :, 0:2] = local[1:, s, :, :, 1:3]
    assert torch.equal(peer, want)
