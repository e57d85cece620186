"""Byte-exact transfers on every CPU backend: random block permutations on both sides, many
layers, concurrent transfers to one and to several peers, layer-wise and whole."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from pdserve.kvtransfer.states import TransferState
from pdserve.kvtransfer.transport import KVTransport
from pdserve.model_runtime.kv_cache.block_pool import BlockPool
from tests.kvtransfer.helpers import SHAPE, pick, same_bytes, transport

BACKENDS = ["tcp", "shm"]


def wait_all(t: KVTransport, ids: set[str], kind: str, timeout: float = 10.0) -> dict[str, object]:
    """Poll until every id appears in ``kind`` (or failed); returns {id: "ok" | cause}."""
    out: dict[str, object] = {}
    deadline = time.monotonic() + timeout
    while set(out) != ids and time.monotonic() < deadline:
        c = t.poll()
        for i in getattr(c, kind):
            out[i] = "ok"
        out.update({i: cause for i, cause in c.failed.items()})
        time.sleep(0.005)
    assert set(out) == ids, f"missing completions: {ids - set(out)}"
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_concurrent_transfers_to_two_peers_are_byte_exact(backend: str, layerwise: bool) -> None:
    rng = random.Random(f"{backend}{layerwise}")
    sender = transport(backend, seed=1)
    receivers = [transport(backend), transport(backend)]
    src_pool = BlockPool(SHAPE[1])
    dst_pools = [BlockPool(SHAPE[1]), BlockPool(SHAPE[1])]
    try:
        addrs = [r.listen() for r in receivers]
        jobs = []
        for i in range(6):  # three transfers to each peer, all in flight together
            peer = i % 2
            n = rng.randint(1, 7)
            src, dst = pick(src_pool, n, rng), pick(dst_pools[peer], n, rng)
            tid = f"{backend}-{layerwise}-{i}"
            receivers[peer].expect(tid, dst)
            jobs.append((tid, peer, src, dst))
        for tid, peer, src, dst in jobs:
            sender.send(tid, addrs[peer], src, dst, layerwise=layerwise)
        if layerwise:
            for layer in range(SHAPE[0]):  # as a model would: layer by layer for the batch
                for tid, *_ in jobs:
                    sender.layer_ready(tid, layer)
        sent = wait_all(sender, {j[0] for j in jobs}, "finished_sending")
        got = {}
        for r in receivers:
            got.update(wait_all(r, {j[0] for j in jobs if receivers[j[1]] is r}, "finished_receiving"))
        assert set(sent.values()) == {"ok"} and set(got.values()) == {"ok"}
        for tid, peer, src, dst in jobs:
            assert same_bytes(sender.cache, src, receivers[peer].cache, dst), tid
            src_pool.free(src)
            dst_pools[peer].free(dst)
        assert src_pool.check_integrity({}).used == 0
        for p in dst_pools:
            assert p.check_integrity({}).used == 0
        assert sender.stats.transfers_sent == 6 and sender.stats.bytes_sent > 0
    finally:
        sender.close()
        for r in receivers:
            r.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_layerwise_receiver_can_wait_per_layer(backend: str) -> None:
    sender, receiver = transport(backend, seed=2), transport(backend)
    try:
        addr = receiver.listen()
        receiver.expect("lw", [5, 3, 9])
        sender.send("lw", addr, [1, 2, 3], [5, 3, 9], layerwise=True)
        assert (
            receiver.wait("lw", 0.2, layers=1) is TransferState.BOOTSTRAPPING
            or receiver.layers_received("lw") == 0
        )
        sender.layer_ready("lw", 1)  # layers 0 and 1 computed
        assert receiver.wait("lw", 5, layers=2) is TransferState.TRANSFERRING
        assert receiver.layers_received("lw") == 2
        assert torch.equal(receiver.cache[:2, 5], sender.cache[:2, 1])
        assert not torch.equal(receiver.cache[2, 5], sender.cache[2, 1])  # not sent yet
        sender.layer_ready("lw", SHAPE[0] - 1)
        assert receiver.wait("lw", 5) is TransferState.DONE
        assert same_bytes(sender.cache, [1, 2, 3], receiver.cache, [5, 3, 9])
    finally:
        sender.close()
        receiver.close()


def test_auto_picks_shm_locally_and_tcp_when_shm_is_not_offered() -> None:
    sender = transport("auto", seed=3)
    shm_rx, tcp_rx = transport("shm"), transport("tcp")
    try:
        assert "shm" in shm_rx.offers and "shm" not in tcp_rx.offers
        for rx, tid in ((shm_rx, "a"), (tcp_rx, "b")):
            addr = rx.listen()
            rx.expect(tid, [0, 1])
            sender.send(tid, addr, [4, 5], [0, 1], peer_offers=rx.offers)
            assert rx.wait(tid, 5) is TransferState.DONE
            assert same_bytes(sender.cache, [4, 5], rx.cache, [0, 1])
        assert set(sender._senders) == {"shm", "tcp"}
    finally:
        for t in (sender, shm_rx, tcp_rx):
            t.close()


def test_many_threads_sending_at_once() -> None:
    sender, receiver = transport("tcp", seed=4), transport("tcp")
    try:
        addr = receiver.listen()
        ids = [f"m{i}" for i in range(12)]
        for i, tid in enumerate(ids):
            receiver.expect(tid, [i * 2, i * 2 + 1])

        def go(i: int, tid: str) -> None:
            sender.send(tid, addr, [40 - i, 10 + i], [i * 2, i * 2 + 1])

        threads = [threading.Thread(target=go, args=(i, tid)) for i, tid in enumerate(ids)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert set(wait_all(receiver, set(ids), "finished_receiving").values()) == {"ok"}
        for i in range(12):
            assert same_bytes(sender.cache, [40 - i, 10 + i], receiver.cache, [i * 2, i * 2 + 1])
    finally:
        sender.close()
        receiver.close()


def test_idle_peers_are_retired_and_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.kvtransfer import sender as sender_mod

    monkeypatch.setattr(sender_mod, "PEER_IDLE_S", 0.2)
    sender, receiver = transport("tcp", seed=9), transport("tcp")
    try:
        addr = receiver.listen()
        receiver.expect("i1", [1])
        sender.send("i1", addr, [2], [1])
        assert receiver.wait("i1", 5) is TransferState.DONE
        s = sender._senders["tcp"]
        deadline = time.monotonic() + 5
        while s._peers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not s._peers  # thread and connection gone
        receiver.expect("i2", [3])
        sender.send("i2", addr, [4], [3])
        assert receiver.wait("i2", 5) is TransferState.DONE
        assert same_bytes(sender.cache, [2, 4], receiver.cache, [1, 3])
    finally:
        sender.close()
        receiver.close()


def test_copies_wait_for_the_marker_taken_on_the_computing_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU path's copy must wait for the engine's stream, which only the engine's thread knows:
    the marker is taken where ``send`` / ``layer_ready`` are called, and the pusher thread's copy
    of those layers is ordered after the latest one."""
    sender, receiver = transport("tcp", seed=4), transport("tcp")
    path = sender._paths["tcp"]
    taken: list[tuple[int, str]] = []
    pushed: list[tuple[range, object]] = []

    def marker() -> object:
        taken.append((threading.get_ident(), f"m{len(taken)}"))
        return taken[-1][1]

    original = path.push_layers

    def push_layers(conn, tid, layers, src, dst, after=None, last=False):  # type: ignore[no-untyped-def]
        pushed.append((layers, after))
        return original(conn, tid, layers, src, dst, after, last)

    monkeypatch.setattr(path, "computed_marker", marker)
    monkeypatch.setattr(path, "push_layers", push_layers)
    try:
        addr = receiver.listen()
        receiver.expect("whole", [1, 2])
        sender.send("whole", addr, [3, 4], [1, 2])
        assert receiver.wait("whole", 5) is TransferState.DONE
        receiver.expect("lw", [5, 6])
        sender.send("lw", addr, [7, 8], [5, 6], layerwise=True)
        sender.layer_ready("lw", 1)
        assert receiver.wait("lw", 5, layers=2) is TransferState.TRANSFERRING
        sender.layer_ready("lw", SHAPE[0] - 1)
        assert receiver.wait("lw", 5) is TransferState.DONE
    finally:
        sender.close()
        receiver.close()
    me = threading.get_ident()
    assert [t for t, _ in taken] == [me, me, me]  # all on this (the "engine's") thread
    assert pushed[0] == (range(0, SHAPE[0]), "m0")
    assert pushed[1] == (range(0, 2), "m1")
    assert pushed[2] == (range(2, SHAPE[0]), "m2")
