"""What a hand-off costs in frames: the frame that carries a transfer's last layers ends it (a
whole direct-write transfer is ``begin``, ``ready`` and one frame), offered by the receiver so
that an older one still gets a ``done`` frame."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.kvtransfer.channel import Connection
from pdserve.kvtransfer.states import FailureCause
from pdserve.kvtransfer.transport import KVTransport
from pdserve.model_runtime.kv_cache.block_pool import BlockPool
from tests.kvtransfer.helpers import SHAPE, pick, raw_client, same_bytes, transport
from tests.kvtransfer.test_faults import assert_empty, outcome, pair

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


Pair = tuple[KVTransport, KVTransport, BlockPool, BlockPool]


def hand_off(pair: Pair, tid: str, n: int, seed: int, layerwise: bool = False) -> tuple[list[int], list[int]]:
    """``n`` blocks sent as transfer ``tid`` over ``pair`` and received byte for byte; returns
    (src, dst), the caller's to free."""
    sender, receiver, spool, rpool = pair
    src, dst = pick(spool, n, random.Random(seed)), pick(rpool, n, random.Random(seed + 1))
    receiver.expect(tid, dst)
    sender.send(tid, receiver.address, src, dst, layerwise=layerwise)
    if layerwise:
        sender.layer_ready(tid, LAYERS - 1)  # every layer computed by the time it is accepted
    assert outcome(receiver, tid) == "received"
    assert same_bytes(sender.cache, src, receiver.cache, dst)
    return src, dst


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_direct_write_hand_off_is_begin_ready_and_one_frame(
    frames: list[tuple[str, dict[str, Any]]], layerwise: bool
) -> None:
    with pair("shm", 3) as p:
        sender, _, spool, rpool = p
        src, dst = hand_off(p, "w", 3, 1, layerwise)
        assert outcome(sender, "w") == "sent"
        # every layer was ready at once (before or after the answer): one frame moves them all
        kinds = [(t, f.get("done", False)) for t, f in of(frames, "w")]
        assert kinds == [("begin", False), ("ready", False), ("layer", True)]
        assert "done" not in [t for t, _ in frames]
    spool.free(src)
    rpool.free(dst)
    assert_empty(spool, rpool)


def test_a_tcp_hand_off_ends_with_its_last_data_frame(frames: list[tuple[str, dict[str, Any]]]) -> None:
    with pair("tcp", 4) as p:
        _, _, spool, rpool = p
        src, dst = hand_off(p, "t", 4, 3)
        sent = of(frames, "t")
        assert [t for t, _ in sent] == ["begin", "ready", *["data"] * LAYERS]  # no done frame
        assert [f.get("done", False) for _, f in sent[2:]] == [False] * (LAYERS - 1) + [True]
    spool.free(src)
    rpool.free(dst)
    assert_empty(spool, rpool)


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


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_receiver_that_offers_no_features_gets_the_first_protocol(
    frames: list[tuple[str, dict[str, Any]]], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either side may be upgraded first: against a receiver that does not offer ``END_FLAG``
    (an older one refuses fields it does not know) the sender ends with a ``done`` frame."""
    monkeypatch.setattr("pdserve.kvtransfer.receiver.FEATURES", ())
    with pair(backend, 7) as p:
        _, _, spool, rpool = p
        src, dst = hand_off(p, "old", 3, 13)
        sent = of(frames, "old")
        body = ["data"] * LAYERS if backend == "tcp" else ["layer"]
        assert [t for t, _ in sent] == ["begin", "ready", *body, "done"]
        assert not any("done" in f for _, f in sent)
    spool.free(src)
    rpool.free(dst)
    assert_empty(spool, rpool)
