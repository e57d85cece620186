"""What a hand-off costs in frames: a whole transfer is ``begin``, ``ready`` and one frame on a
direct-write path, and ``begin`` plus its data (no answer awaited) on tcp; the shortcuts keep
every refusal safe."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.kvtransfer.channel import Connection
from pdserve.kvtransfer.states import FailureCause, TransferState
from pdserve.model_runtime.kv_cache.block_pool import BlockPool
from tests.kvtransfer.helpers import SHAPE, pick, raw_client, same_bytes, transport
from tests.kvtransfer.test_faults import assert_empty, outcome
from tests.service.helpers import wait_for

LAYERS = SHAPE[0]


@pytest.fixture
def frames(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every frame sent in this process (both transports of a test live in it), in order."""
    sent: list[tuple[str, dict[str, Any]]] = []
    lock = threading.Lock()
    original = Connection.send

    def send(self: Connection, frame_type: str, payload: Any = (), **fields: Any) -> None:
        with lock:
            sent.append((frame_type, fields))
        original(self, frame_type, payload, **fields)

    monkeypatch.setattr(Connection, "send", send)
    yield sent


def of(frames: list[tuple[str, dict[str, Any]]], tid: str) -> list[tuple[str, dict[str, Any]]]:
    return [(t, f) for t, f in frames if f.get("id") == tid]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_direct_write_hand_off_is_begin_ready_and_one_frame(
    frames: list[tuple[str, dict[str, Any]]], layerwise: bool
) -> None:
    sender, receiver = transport("shm", seed=3), transport("shm")
    spool, rpool = BlockPool(SHAPE[1]), BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        src, dst = pick(spool, 3, random.Random(1)), pick(rpool, 3, random.Random(2))
        receiver.expect("w", dst)
        sender.send("w", addr, src, dst, layerwise=layerwise)
        if layerwise:
            sender.layer_ready("w", LAYERS - 1)  # every layer computed by the time it is accepted
        assert outcome(receiver, "w") == "received"
        assert outcome(sender, "w") == "sent"
        assert same_bytes(sender.cache, src, receiver.cache, dst)
        # every layer was ready at once (before or after the answer): one frame moves them all
        kinds = [(t, f.get("done", False)) for t, f in of(frames, "w")]
        assert kinds == [("begin", False), ("ready", False), ("layer", True)]
        assert "done" not in [t for t, _ in frames]
    finally:
        sender.close()
        receiver.close()
    spool.free(src)
    rpool.free(dst)
    assert_empty(spool, rpool)


def test_tcp_sends_data_behind_begin_without_an_answer(frames: list[tuple[str, dict[str, Any]]]) -> None:
    sender, receiver = transport("tcp", seed=4), transport("tcp")
    spool, rpool = BlockPool(SHAPE[1]), BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        src, dst = pick(spool, 4, random.Random(3)), pick(rpool, 4, random.Random(4))
        receiver.expect("t", dst)
        sender.send("t", addr, src, dst)
        assert outcome(receiver, "t") == "received"
        assert same_bytes(sender.cache, src, receiver.cache, dst)
        sent = of(frames, "t")
        assert sent[0] == ("begin", {**sent[0][1], "eager": True})
        assert [t for t, _ in sent[1:]] == ["data"] * LAYERS  # no ready, no done frame
        assert [f.get("done", False) for _, f in sent[1:]] == [False] * (LAYERS - 1) + [True]
    finally:
        sender.close()
        receiver.close()
    spool.free(src)
    rpool.free(dst)
    assert_empty(spool, rpool)


def test_refused_eager_data_is_read_past_and_the_connection_goes_on() -> None:
    """Blocks that differ from the reservation: the receiver refuses the begin and reads the
    data that already followed it past its cache; the next transfer on the same connection
    arrives intact and nothing of the refused one landed."""
    sender, receiver = transport("tcp", seed=5), transport("tcp")
    spool, rpool = BlockPool(SHAPE[1]), BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        src = pick(spool, 3, random.Random(5))
        reserved, other = pick(rpool, 3, random.Random(6)), pick(rpool, 3, random.Random(7))
        receiver.expect("bad", reserved)
        sender.send("bad", addr, src, other)
        assert outcome(receiver, "bad") is FailureCause.REJECTED
        # a whole transfer is usually all out before the answer: DONE on the sender, and the
        # refusal counted when it comes; or the answer came between begin and data
        if outcome(sender, "bad") == "sent":
            wait_for(lambda: sender.stats.failures["rejected_after_send"] == 1, 5, "the refusal")
        else:
            assert sender.state("bad") is TransferState.FAILED
        receiver.expect("good", reserved)
        sender.send("good", addr, src, reserved)
        assert outcome(receiver, "good") == "received"
        assert same_bytes(sender.cache, src, receiver.cache, reserved)
        # the refused data went nowhere (read after it, on the same stream, so it is all read)
        assert not any(same_bytes(sender.cache, [s], receiver.cache, [d]) for s in src for d in other)
        assert receiver.stats.ignored_frames >= LAYERS  # the refused data frames, read past
    finally:
        sender.close()
        receiver.close()
    spool.free(src)
    rpool.free(reserved + other)
    assert_empty(spool, rpool)


def test_eager_begin_on_a_direct_write_path_is_refused() -> None:
    """A direct-write sender must hold the fence the ``ready`` carries before it writes."""
    receiver = transport("shm")
    pool = BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        dst = pick(pool, 2, random.Random(8))
        receiver.expect("e", dst)
        conn = raw_client(addr, backend="shm")
        conn.send("begin", id="e", dst_blocks=dst, num_layers=LAYERS, layerwise=False, eager=True)
        answer = conn.read_frame()
        assert answer["t"] == "reject" and "must wait for ready" in answer["reason"]
        assert outcome(receiver, "e") is FailureCause.REJECTED
        conn.close()
    finally:
        receiver.close()
    pool.free(dst)
    assert_empty(pool)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_done_frame_with_layers_missing_fails_the_transfer(backend: str) -> None:
    receiver = transport(backend)
    pool = BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        dst = pick(pool, 1, random.Random(9))
        receiver.expect("m", dst)
        conn = raw_client(addr, backend=backend)
        conn.send("begin", id="m", dst_blocks=dst, num_layers=LAYERS, layerwise=False)
        assert conn.read_frame()["t"] == "ready"
        if backend == "shm":
            conn.send("layer", id="m", layer=0, count=LAYERS - 1, done=True)
        else:
            payload = [bytes(receiver._receiver.paths["tcp"].block_nbytes)]
            conn.send("data", payload, id="m", layer=0, first=0, count=1, done=True)
        assert outcome(receiver, "m") is FailureCause.PROTOCOL
        conn.close()
    finally:
        receiver.close()
    pool.free(dst)
    assert_empty(pool)


def test_a_refusal_stops_an_eager_transfer_still_under_way(frames: list[tuple[str, dict[str, Any]]]) -> None:
    """A layer-wise tcp transfer refused before any layer is computed fails on the sender and
    sends no data."""
    sender, receiver = transport("tcp", seed=6), transport("tcp")
    spool, rpool = BlockPool(SHAPE[1]), BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        src = pick(spool, 2, random.Random(10))
        reserved, other = pick(rpool, 2, random.Random(11)), pick(rpool, 2, random.Random(12))
        receiver.expect("lw", reserved)
        sender.send("lw", addr, src, other, layerwise=True)
        assert outcome(sender, "lw") is FailureCause.REJECTED
        sender.layer_ready("lw", LAYERS - 1)  # computed after all: nothing goes out
        assert outcome(receiver, "lw") is FailureCause.REJECTED
        assert [t for t, _ in of(frames, "lw")] == ["begin", "reject"]
    finally:
        sender.close()
        receiver.close()
    spool.free(src)
    rpool.free(reserved + other)
    assert_empty(spool, rpool)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_receiver_that_offers_no_features_gets_the_first_protocol(
    frames: list[tuple[str, dict[str, Any]]], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either side may be upgraded first: against a receiver that offers neither ``END_FLAG``
    nor ``EAGER`` (an older one refuses fields it does not know) the sender waits for
    ``ready`` and ends with a ``done`` frame."""
    monkeypatch.setattr("pdserve.kvtransfer.receiver.features", lambda path: [])
    sender, receiver = transport(backend, seed=7), transport(backend)
    spool, rpool = BlockPool(SHAPE[1]), BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        src, dst = pick(spool, 3, random.Random(13)), pick(rpool, 3, random.Random(14))
        receiver.expect("old", dst)
        sender.send("old", addr, src, dst)
        assert outcome(receiver, "old") == "received"
        assert same_bytes(sender.cache, src, receiver.cache, dst)
        sent = of(frames, "old")
        body = ["data"] * LAYERS if backend == "tcp" else ["layer"]
        assert [t for t, _ in sent] == ["begin", "ready", *body, "done"]
        assert not any("eager" in f or "done" in f for _, f in sent)
    finally:
        sender.close()
        receiver.close()
    spool.free(src)
    rpool.free(dst)
    assert_empty(spool, rpool)


def test_an_eager_senders_done_is_not_the_receivers() -> None:
    """A tcp receiver that never takes the ``begin``: the eager sender has handed everything to
    the connection (DONE); the receiver still holds nothing and fails its record at the lease's
    end — the decode side, not the sender, says whether the KV arrived."""
    sender, receiver = transport("tcp", seed=8), transport("tcp")
    spool, rpool = BlockPool(SHAPE[1]), BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        receiver._receiver._on_begin = lambda *a: None  # type: ignore[method-assign]
        src, dst = pick(spool, 2, random.Random(15)), pick(rpool, 2, random.Random(16))
        receiver.expect("mute", dst, lease_s=0.5)
        sender.send("mute", addr, src, dst)
        assert outcome(sender, "mute") == "sent"
        assert outcome(receiver, "mute") is FailureCause.TIMEOUT
        assert not any(same_bytes(sender.cache, [s], receiver.cache, [d]) for s in src for d in dst)
    finally:
        sender.close()
        receiver.close()
    spool.free(src)
    rpool.free(dst)
    assert_empty(spool, rpool)
