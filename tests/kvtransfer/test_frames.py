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
from pdserve.kvtransfer.states import FailureCause
from pdserve.model_runtime.kv_cache.block_pool import BlockPool
from tests.kvtransfer.helpers import SHAPE, pick, raw_client, same_bytes, transport
from tests.kvtransfer.test_faults import assert_empty, outcome

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
        kinds = [(t, f.get("done", False)) for t, f in of(frames, "w")]
        if layerwise:  # the layers may become ready before or after the answer: 1 or 2 frames
            assert kinds[:2] == [("begin", False), ("ready", False)] and kinds[-1] == ("layer", True)
            assert all(k == ("layer", False) for k in kinds[2:-1]) and len(kinds) <= 4
        else:
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
        assert outcome(sender, "bad") in ("sent", FailureCause.REJECTED)  # it may finish first
        assert not any(same_bytes(sender.cache, src[:1], receiver.cache, [d]) for d in reserved + other)
        receiver.expect("good", reserved)
        sender.send("good", addr, src, reserved)
        assert outcome(receiver, "good") == "received"
        assert same_bytes(sender.cache, src, receiver.cache, reserved)
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
