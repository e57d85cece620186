"""Faults: each ends with both pools consistent and empty, and the survivor serving the next
transfer byte-exactly."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch

from pdserve.kvtransfer import wire
from pdserve.kvtransfer.channel import Connection
from pdserve.kvtransfer.states import FailureCause, TransferError, TransferState
from pdserve.kvtransfer.transport import KVTransport
from pdserve.model_runtime.kv_cache.block_pool import BlockPool
from tests.kvtransfer import peers
from tests.kvtransfer.helpers import SECRET, SHAPE, cache, pick, raw_client, same_bytes, transport

CTX = mp.get_context("spawn")


def outcome(t: KVTransport, tid: str, timeout: float = 10.0) -> object:
    """Poll until ``tid`` completes; "sent", "received" or its failure cause."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = t.poll()
        if tid in c.failed:
            return c.failed[tid]
        if tid in c.finished_sending:
            return "sent"
        if tid in c.finished_receiving:
            return "received"
        time.sleep(0.01)
    raise AssertionError(f"{tid} never completed")


def serves_next(receiver: KVTransport, pool: BlockPool, backend: str = "tcp", tid: str = "next") -> None:
    """A fresh sender's transfer into ``receiver`` completes byte-exactly; blocks come back."""
    rng = random.Random(tid)
    sender = transport(backend, seed=11)
    try:
        dst = pick(pool, 3, rng)
        receiver.expect(tid, dst)
        sender.send(tid, receiver.address, [7, 8, 9], dst)
        assert outcome(receiver, tid) == "received"
        assert same_bytes(sender.cache, [7, 8, 9], receiver.cache, dst)
        pool.free(dst)
    finally:
        sender.close()


@contextlib.contextmanager
def pair(backend: str, seed: int) -> Iterator[tuple[KVTransport, KVTransport, BlockPool, BlockPool]]:
    """A listening receiver, a sender, and a block pool for each; closed afterwards."""
    sender, receiver = transport(backend, seed=seed), transport(backend)
    try:
        receiver.listen()
        yield sender, receiver, BlockPool(SHAPE[1]), BlockPool(SHAPE[1])
    finally:
        sender.close()
        receiver.close()


def begun_raw(
    receiver: KVTransport, pool: BlockPool, tid: str, lease_s: float
) -> tuple[Connection, list[int]]:
    """A raw, authenticated connection on which ``tid`` has been begun and accepted."""
    dst = pick(pool, 2, random.Random(tid))
    receiver.expect(tid, dst, lease_s=lease_s)
    conn = raw_client(receiver.address)
    conn.send("begin", id=tid, dst_blocks=dst, num_layers=SHAPE[0], layerwise=False)
    assert conn.read_frame()["t"] == "ready"
    return conn, dst


def recovers(receiver: KVTransport, pool: BlockPool, conn: Connection, dst: list[int]) -> None:
    """After a fault on ``conn``: free the failed transfer's blocks, then the receiver must be
    consistent, empty, and serve the next transfer."""
    conn.close()
    pool.free(dst)
    assert_empty(pool)
    serves_next(receiver, pool)


def assert_empty(*pools: BlockPool) -> None:
    for p in pools:
        assert p.check_integrity({}).used == 0


@pytest.fixture(params=["tcp", "shm"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_sender_killed_mid_transfer(backend: str) -> None:
    receiver = transport(backend)
    pool = BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        dst = pick(pool, 6, random.Random(1))
        receiver.expect("k", dst, lease_s=60)
        parent, child = CTX.Pipe()
        proc = CTX.Process(
            target=peers.sender_process, args=(child, backend, addr, "k", list(range(6)), dst, 2)
        )
        proc.start()
        assert parent.poll(60) and parent.recv() == "sent"
        assert receiver.layers_received("k") >= 1 and receiver.state("k") is TransferState.TRANSFERRING
        proc.kill()
        proc.join()
        assert outcome(receiver, "k") is FailureCause.PEER_LOST
        pool.free(dst)
        assert_empty(pool)
        serves_next(receiver, pool, backend)
        assert_empty(pool)
    finally:
        receiver.close()


def test_receiver_killed_mid_transfer(backend: str) -> None:
    sender = transport(backend, seed=3)
    pool = BlockPool(SHAPE[1])
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=peers.receiver_process, args=(child, backend))
    proc.start()
    try:
        assert parent.poll(60)
        addr, offers = parent.recv()
        parent.send(("expect", "r", [1, 2, 3, 4]))
        assert parent.recv() == "ok"
        src = pick(pool, 4, random.Random(2))
        sender.send("r", addr, src, [1, 2, 3, 4], layerwise=True, peer_offers=offers)
        sender.layer_ready("r", 0)
        deadline = time.monotonic() + 10
        while sender.stats.bytes_sent == 0 and time.monotonic() < deadline:
            if sender._senders[backend]._transfers["r"].layers_sent:
                break
            time.sleep(0.01)
        proc.kill()
        proc.join()
        # The sender learns of the death from its connection's reader (EOF). Without an
        # end-to-end acknowledgement, a last write racing that notice can still complete as
        # sent (a gap of the wire protocol, not what this test is about): let the notice land.
        peer = sender._senders[backend]._peers[addr]
        deadline = time.monotonic() + 5
        while peer.conn is not None and not peer.conn.closed.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        sender.layer_ready("r", SHAPE[0] - 1)  # the next writes find the peer gone
        assert outcome(sender, "r") in (FailureCause.PEER_LOST, FailureCause.TIMEOUT)
        pool.free(src)
        assert_empty(pool)
        # The sender still serves: a new receiver gets a new transfer.
        rx = transport(backend)
        try:
            rx.listen()
            rx.expect("r2", [0, 5])
            sender.send("r2", rx.address, [10, 11], [0, 5], peer_offers=rx.offers)
            assert outcome(rx, "r2") == "received" and outcome(sender, "r2") == "sent"
            assert same_bytes(sender.cache, [10, 11], rx.cache, [0, 5])
        finally:
            rx.close()
    finally:
        sender.close()
        if proc.is_alive():
            proc.kill()


def test_sender_stall_beyond_its_deadline(backend: str) -> None:
    """Layers never become ready: the sender gives up, tells the receiver, both free."""
    with pair(backend, 4) as (sender, receiver, spool, rpool):
        src, dst = pick(spool, 2, random.Random(3)), pick(rpool, 2, random.Random(4))
        receiver.expect("s", dst, lease_s=60)
        sender.send("s", receiver.address, src, dst, layerwise=True, timeout_s=0.5)
        sender.layer_ready("s", 0)
        assert outcome(sender, "s") is FailureCause.TIMEOUT
        spool.free(src)
        assert outcome(receiver, "s") is FailureCause.CANCELLED
        rpool.free(dst)
        assert_empty(spool, rpool)
        serves_next(receiver, rpool, backend)


def test_receiver_lease_expires_while_sender_stalls(backend: str) -> None:
    """The receiver's lease runs out mid-transfer: a direct-write sender is told to stop first."""
    with pair(backend, 5) as (sender, receiver, spool, rpool):
        src, dst = pick(spool, 3, random.Random(5)), pick(rpool, 3, random.Random(6))
        receiver.expect("l", dst, lease_s=0.5)
        sender.send("l", receiver.address, src, dst, layerwise=True, timeout_s=60)
        sender.layer_ready("l", 0)
        assert outcome(receiver, "l") is FailureCause.TIMEOUT
        rpool.free(dst)
        if backend == "shm":  # the sender confirmed it stopped before the receiver let go
            assert outcome(sender, "l") is FailureCause.CANCELLED
        else:
            sender.cancel("l")
            assert outcome(sender, "l") is FailureCause.CANCELLED
        spool.free(src)
        assert_empty(spool, rpool)
        serves_next(receiver, rpool, backend)


def test_unconfirming_direct_writer_loses_its_blocks_at_the_write_fence() -> None:
    """A direct-write sender that never answers the abort: the receiver releases the blocks at
    lease end + grace (the sender was told it may not write after the lease) and drops it."""
    receiver = transport("shm", fence_grace_s=0.3)
    pool = BlockPool(SHAPE[1])
    try:
        receiver.listen()
        dst = pick(pool, 2, random.Random("fence"))
        receiver.expect("f", dst, lease_s=0.3)
        conn = raw_client(receiver.address, backend="shm")
        t0 = time.monotonic()
        conn.send("begin", id="f", dst_blocks=dst, num_layers=SHAPE[0], layerwise=True)
        ready = conn.read_frame()
        assert ready["t"] == "ready"
        assert abs(ready["write_until_ns"] / 1e9 - (t0 + 0.3)) < 0.2  # the lease's end, host clock
        assert conn.read_frame()["t"] == "abort"  # lease over: told to stop; never confirms
        assert outcome(receiver, "f") is FailureCause.TIMEOUT
        assert time.monotonic() - t0 >= 0.55  # not before lease + grace
        with pytest.raises((TransferError, wire.FrameError)):
            conn.read_frame()  # and the receiver hung up on it
        conn.close()
        pool.free(dst)
        assert_empty(pool)
        serves_next(receiver, pool, "shm")
    finally:
        receiver.close()


def test_direct_writer_starts_no_write_after_the_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even when the abort never reaches it, the sender does not write past the receiver's lease,
    so blocks the receiver released at the fence stay untouched."""
    with pair("shm", 12) as (sender, receiver, spool, rpool):
        monkeypatch.setattr(receiver._receiver, "_send_abort", lambda *a: None)  # abort lost
        src, dst = pick(spool, 3, random.Random(12)), pick(rpool, 3, random.Random(13))
        receiver.expect("w", dst, lease_s=0.4)
        sender.send("w", receiver.address, src, dst, layerwise=True, timeout_s=60)
        sender.layer_ready("w", 0)
        deadline = time.monotonic() + 5
        while receiver.layers_received("w") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.layers_received("w") == 1
        time.sleep(0.5)  # the lease is over; the sender never heard
        sender.layer_ready("w", SHAPE[0] - 1)
        assert outcome(sender, "w") is FailureCause.TIMEOUT
        spool.free(src)
        assert outcome(receiver, "w") is FailureCause.TIMEOUT
        assert all(torch.count_nonzero(receiver.cache[1:, d]) == 0 for d in dst)  # nothing written
        rpool.free(dst)
        assert_empty(spool, rpool)
        serves_next(receiver, rpool, "shm")


def test_unanswered_begin_times_out_on_the_sender() -> None:
    """A peer that accepts the connection but never answers ``begin``: the sender gives up after
    its I/O timeout and serves the next transfer to another peer."""
    silent = transport("tcp")
    sender = transport("tcp", seed=14, io_timeout_s=0.3)
    pool = BlockPool(SHAPE[1])
    try:
        silent.listen()
        silent._receiver._on_begin = lambda *a: None  # type: ignore[method-assign]
        silent.expect("q", [0, 1])
        t0 = time.monotonic()
        sender.send("q", silent.address, [2, 3], [0, 1])
        assert outcome(sender, "q") is FailureCause.TIMEOUT
        assert time.monotonic() - t0 < 3
        receiver = transport("tcp")
        try:
            receiver.listen()
            dst = pick(pool, 2, random.Random(14))
            receiver.expect("q2", dst)
            sender.send("q2", receiver.address, [2, 3], dst)
            assert outcome(receiver, "q2") == "received"
            assert same_bytes(sender.cache, [2, 3], receiver.cache, dst)
            pool.free(dst)
        finally:
            receiver.close()
    finally:
        sender.close()
        silent.close()
    assert_empty(pool)


def test_raw_stall_after_begin_times_out_on_the_receiver() -> None:
    receiver = transport("tcp")
    pool = BlockPool(SHAPE[1])
    try:
        receiver.listen()
        conn, dst = begun_raw(receiver, pool, "st", lease_s=0.3)
        assert outcome(receiver, "st") is FailureCause.TIMEOUT
        pool.free(dst)
        # Late frames for the expired transfer are drained and ignored, the connection lives on.
        payload = [torch.zeros(SHAPE[2:]).numpy() for _ in dst]
        conn.send("data", payload, id="st", layer=0, first=0, count=2)
        conn.send("done", id="st")
        time.sleep(0.2)
        assert receiver.stats.ignored_frames >= 2
        conn.close()
        assert_empty(pool)
        serves_next(receiver, pool)
    finally:
        receiver.close()


def _marker_pickle(path: Path) -> bytes:
    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {path}",))

    return pickle.dumps(Evil())


def _bad_inputs(tmp: Path) -> dict[str, bytes]:
    wrong_types = msgpack.packb({"v": 1, "t": "data", "id": "b", "layer": "0", "first": 0, "count": 1})
    return {
        "truncated": wire.LENGTH.pack(100) + b"\x81\xa1v\x01" + b"x" * 6,
        "wrong_types": wire.LENGTH.pack(len(wrong_types)) + wrong_types,
        "oversize_length": b"\xff\xff\xff\xff" + b"\x00" * 16,
        "deep_nesting": wire.LENGTH.pack(2001) + b"\x91" * 2000 + b"\xc0",
        "pickle": (lambda p: wire.LENGTH.pack(len(p)) + p)(_marker_pickle(tmp / "unpickled")),
    }


@pytest.mark.parametrize("case", ["truncated", "wrong_types", "oversize_length", "deep_nesting", "pickle"])
def test_malformed_frames_drop_the_connection_and_fail_its_transfer(case: str, tmp_path: Path) -> None:
    receiver = transport("tcp")
    pool = BlockPool(SHAPE[1])
    try:
        receiver.listen()
        conn, dst = begun_raw(receiver, pool, "b", lease_s=60)
        data = _bad_inputs(tmp_path)[case]
        conn.sock.sendall(data)
        if case == "truncated":
            conn.sock.shutdown(1)  # the rest never comes
        assert outcome(receiver, "b") is FailureCause.PEER_LOST
        assert not (tmp_path / "unpickled").exists()
        recovers(receiver, pool, conn, dst)
    finally:
        receiver.close()


def test_wrong_secret_and_layout_mismatch_are_refused() -> None:
    receiver = transport("tcp")
    pool = BlockPool(SHAPE[1])
    impostor = KVTransport(cache(seed=3)[0], b"not-the-right-secret!!", receiver.config)
    other_shape = (SHAPE[0], SHAPE[1], 2, SHAPE[3], SHAPE[4], SHAPE[5] * 2)
    mismatched = transport("tcp", seed=1, shape=other_shape)
    # Same shape, other storage order: a direct-write sender would scatter bytes with the wrong
    # strides, so it is a layout mismatch too.
    layer_major = KVTransport(torch.zeros(SHAPE), SECRET, receiver.config)
    try:
        addr = receiver.listen()
        dst = pick(pool, 2, random.Random(9))
        receiver.expect("w", dst, lease_s=60)
        impostor.send("w", addr, [0, 1], dst)
        assert outcome(impostor, "w") is FailureCause.AUTH
        mismatched.send("w", addr, [0, 1], dst)
        assert outcome(mismatched, "w") is FailureCause.LAYOUT_MISMATCH
        layer_major.send("w", addr, [0, 1], dst)
        assert outcome(layer_major, "w") is FailureCause.LAYOUT_MISMATCH
        assert receiver.state("w") is TransferState.BOOTSTRAPPING  # untouched by either
        with pytest.raises(TransferError, match="refused"):
            raw_client(addr, secret=b"wrong-secret-wrong-secret")
    finally:
        impostor.close()
        mismatched.close()
        layer_major.close()
    try:
        receiver.cancel("w")
        assert outcome(receiver, "w") is FailureCause.CANCELLED
        pool.free(dst)
        assert_empty(pool)
        serves_next(receiver, pool)
    finally:
        receiver.close()


def test_begin_for_other_blocks_is_rejected() -> None:
    sender, receiver = transport("shm", seed=6), transport("shm")
    try:
        receiver.listen()
        receiver.expect("x", [1, 2])
        sender.send("x", receiver.address, [3, 4], [2, 1])  # not the reserved order: refused
        assert outcome(sender, "x") is FailureCause.REJECTED
        assert outcome(receiver, "x") is FailureCause.REJECTED
        assert not torch.equal(receiver.cache[:, 2], sender.cache[:, 3])  # nothing was written
    finally:
        sender.close()
        receiver.close()


def test_lease_expiry_waits_for_the_receivers_own_read_to_end() -> None:
    """Blocks being filled by our reader are not released under it: the failure is reported
    only once that read has returned (here: timed out)."""
    receiver = transport("tcp", io_timeout_s=3.0)
    pool = BlockPool(SHAPE[1])
    try:
        receiver.listen()
        conn, dst = begun_raw(receiver, pool, "half", lease_s=0.3)
        block = torch.zeros(SHAPE[2:]).numpy()
        conn.send("data", [block], id="half", layer=0, first=0, count=2)  # one of two blocks
        time.sleep(0.8)  # lease expired, but the reader is still inside the payload
        assert not receiver.poll() and receiver.state("half") is TransferState.TRANSFERRING
        assert outcome(receiver, "half") is FailureCause.TIMEOUT
        recovers(receiver, pool, conn, dst)
    finally:
        receiver.close()


def test_a_second_begin_does_not_fail_a_live_transfer() -> None:
    sender, receiver = transport("shm", seed=8), transport("shm")
    try:
        addr = receiver.listen()
        receiver.expect("dup", [4, 5])
        sender.send("dup", addr, [1, 2], [4, 5], layerwise=True)
        sender.layer_ready("dup", 0)
        assert receiver.wait("dup", 5, layers=1) is TransferState.TRANSFERRING
        intruder = raw_client(addr, backend="shm")
        intruder.send("begin", id="dup", dst_blocks=[4, 5], num_layers=SHAPE[0], layerwise=False)
        assert intruder.read_frame()["t"] == "reject"
        intruder.close()
        sender.layer_ready("dup", SHAPE[0] - 1)
        assert outcome(receiver, "dup") == "received"
        assert same_bytes(sender.cache, [1, 2], receiver.cache, [4, 5])
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("frame", ["out_of_order", "layer_on_tcp"])
def test_frames_that_would_fake_completeness_drop_the_connection(frame: str) -> None:
    receiver = transport("tcp")
    pool = BlockPool(SHAPE[1])
    try:
        receiver.listen()
        conn, dst = begun_raw(receiver, pool, "fake", lease_s=60)
        block = torch.zeros(SHAPE[2:]).numpy()
        with contextlib.suppress(TransferError):  # the receiver hangs up part-way
            if frame == "out_of_order":
                conn.send("data", [block], id="fake", layer=0, first=0, count=1)
                conn.send("data", [block], id="fake", layer=0, first=0, count=1)  # the same block again
            else:
                for layer in range(SHAPE[0]):
                    conn.send("layer", id="fake", layer=layer, count=1)
                conn.send("done", id="fake")
        assert outcome(receiver, "fake") is FailureCause.PEER_LOST
        recovers(receiver, pool, conn, dst)
    finally:
        receiver.close()


def test_oversized_hello_is_dropped_before_decoding() -> None:
    receiver = transport("tcp")
    pool = BlockPool(SHAPE[1])
    try:
        host, _, port = receiver.listen().rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=2)
        (n,) = wire.LENGTH.unpack(sock.recv(4))
        sock.recv(n)  # the challenge
        sock.sendall(wire.LENGTH.pack(100_000) + b"\x80" * 1000)
        sock.settimeout(2)
        assert sock.recv(1) == b""  # closed without reading the rest
        sock.close()
        serves_next(receiver, pool)
        assert_empty(pool)
    finally:
        receiver.close()


def test_trickling_unauthenticated_peer_is_cut_at_the_handshake_deadline() -> None:
    """One byte every 0.3 s never trips a 1 s per-read timeout; the handshake's own deadline
    must still close the connection (and free its slot) about 1 s after it opened."""
    receiver = transport("tcp", io_timeout_s=5.0, handshake_timeout_s=1.0)
    pool = BlockPool(SHAPE[1])
    try:
        host, _, port = receiver.listen().rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=2)
        t0 = time.monotonic()
        (n,) = wire.LENGTH.unpack(sock.recv(4))
        sock.recv(n)  # the challenge
        sock.sendall(wire.LENGTH.pack(200))
        sock.settimeout(0.3)
        closed_after = None
        while time.monotonic() - t0 < 5.0:
            try:
                if sock.recv(1) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except TimeoutError:
                pass
            except OSError:
                closed_after = time.monotonic() - t0
                break
            try:
                sock.sendall(b"\x80")
            except OSError:
                closed_after = time.monotonic() - t0
                break
        sock.close()
        assert closed_after is not None and closed_after < 2.0, closed_after
        serves_next(receiver, pool)
        assert_empty(pool)
    finally:
        receiver.close()


def test_transfers_go_through_a_flood_of_unauthenticated_connections() -> None:
    """300 idle connections (more than the listener's 256 senders), reopened as they close,
    must not keep real senders out: every transfer completes, byte-exact, while the flood
    goes on, and the receiver holds at most its bound of unauthenticated connections."""
    from benchmarks import flood
    from pdserve.kvtransfer.admission import MAX_PENDING

    receiver = transport("tcp")
    pool = BlockPool(SHAPE[1])
    proc = flood.start([receiver.listen()], 300, seconds=60.0)
    try:
        flood.wait_ready(proc)
        for i in range(4):
            serves_next(receiver, pool, "tcp", tid=f"flood-{i}")
            pending = len(receiver._receiver._pending)  # type: ignore[attr-defined]
            assert pending <= MAX_PENDING, pending
        counts = flood.result(proc)
        assert counts["opened"] > 300 and counts["closed_by_listener"] > 0, counts  # reopened what was shed
        assert_empty(pool)
    finally:
        if proc.poll() is None:
            proc.kill()
        receiver.close()


def test_a_sender_connects_again_after_a_reset() -> None:
    """A receiver that resets the first connection attempts (as one shedding unauthenticated
    connections does) costs the sender a retry, not the transfer."""
    receiver = transport("tcp")
    pool = BlockPool(SHAPE[1])
    try:
        address = receiver.listen()
        inner = receiver._receiver  # type: ignore[attr-defined]
        real_serve, dropped = inner._serve, [0]

        def drop_twice(conn: Connection) -> None:
            if dropped[0] < 2:
                dropped[0] += 1
                conn.close()
                inner._on_conn_lost(conn)
                return
            real_serve(conn)

        inner._serve = drop_twice
        sender = transport("tcp", seed=12)
        try:
            dst = pick(pool, 2, random.Random(5))
            receiver.expect("again", dst)
            sender.send("again", address, [1, 2], dst)
            assert outcome(receiver, "again") == "received" and outcome(sender, "again") == "sent"
            assert dropped[0] == 2 and sender.stats.connect_retries == 2
            pool.free(dst)
        finally:
            sender.close()
        assert_empty(pool)
    finally:
        receiver.close()
