"""KV channels over TLS (``--internal-tls``): byte-exact transfers, ciphertext on the wire,
and refusals of peers without the deployment's certificate, each without a hang or a leak."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time

import pytest

from pdserve.kvtransfer.states import FailureCause
from pdserve.kvtransfer.tls import InternalTls, InternalTlsError, TlsStream
from pdserve.model_runtime.kv_cache.block_pool import BlockPool
from tests.kvtransfer.helpers import SHAPE, pick, same_bytes, transport
from tests.kvtransfer.test_transfer import wait_all

TLS = InternalTls.generate()


class Tap:
    """A TCP relay that keeps every byte it forwards (what an eavesdropper on the link sees)."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.seen = bytearray()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_transfers_over_tls_are_byte_exact_and_encrypted_on_the_wire(backend: str) -> None:
    rng = random.Random(backend)
    sender, receiver = transport(backend, seed=3, tls=TLS), transport(backend, tls=TLS)
    src_pool, dst_pool = BlockPool(SHAPE[1]), BlockPool(SHAPE[1])
    tap = Tap(receiver.listen())
    try:
        jobs = []
        for i in range(4):
            n = rng.randint(1, 9)
            src, dst = pick(src_pool, n, rng), pick(dst_pool, n, rng)
            receiver.expect(f"transfer-id-{i}", dst)
            jobs.append((f"transfer-id-{i}", src, dst))
        for tid, src, dst in jobs:
            sender.send(tid, tap.address, src, dst, layerwise=True)
        for layer in range(SHAPE[0]):
            for tid, *_ in jobs:
                sender.layer_ready(tid, layer)
        ids = {j[0] for j in jobs}
        assert set(wait_all(sender, ids, "finished_sending").values()) == {"ok"}
        assert set(wait_all(receiver, ids, "finished_receiving").values()) == {"ok"}
        for tid, src, dst in jobs:
            assert same_bytes(sender.cache, src, receiver.cache, dst), tid
            src_pool.free(src)
            dst_pool.free(dst)
            sender.forget(tid)
            receiver.forget(tid)
        assert src_pool.check_integrity({}).used == 0 and dst_pool.check_integrity({}).used == 0
        assert sender.num_records() == 0 and receiver.num_records() == 0
        # Nothing a listener on the link could read: no frame names, no block of the cache.
        assert len(tap.seen) > 0
        for marker in (b"challenge", b"hello", b"begin", b"layout", b"transfer-id-0"):
            assert marker not in tap.seen, marker
        block = sender.cache[0, jobs[0][1][0]].numpy().tobytes()
        assert block[:64] not in tap.seen
    finally:
        tap.close()
        sender.close()
        receiver.close()


_OTHER = InternalTls.generate()
# What a sender without this deployment's certificate is told. Plaintext: the receiver drops a
# connection that does not speak TLS (or the sender's read times out). Another deployment's CA
# and certificate: the sender's own handshake refuses the receiver's certificate. Another
# deployment's certificate under this deployment's CA: under TLS 1.3 the sender's handshake
# completes, and the receiver's refusal arrives as an alert at its first read — a configuration
# to fix (AUTH), not a lost peer.
_REFUSED = {
    "plaintext": (None, (FailureCause.AUTH, FailureCause.PEER_LOST, FailureCause.TIMEOUT)),
    "other-deployment": (_OTHER, (FailureCause.AUTH,)),
    "other-certificate": (
        InternalTls(ca_pem=TLS.ca_pem, cert_pem=_OTHER.cert_pem, key_pem=_OTHER.key_pem),
        (FailureCause.AUTH,),
    ),
}


@pytest.mark.parametrize("peer", list(_REFUSED))
def test_a_peer_without_the_deployments_certificate_is_refused(peer: str) -> None:
    peer_tls, causes = _REFUSED[peer]
    receiver = transport("tcp", tls=TLS, io_timeout_s=2.0)
    sender = transport("tcp", seed=1, tls=peer_tls, io_timeout_s=2.0)
    pool = BlockPool(SHAPE[1])
    try:
        addr = receiver.listen()
        receiver.expect("x", [1, 2], lease_s=5)
        started = time.monotonic()
        sender.send("x", addr, [3, 4], [1, 2])
        out = wait_all(sender, {"x"}, "finished_sending", timeout=10)
        assert out["x"] in causes, out
        assert time.monotonic() - started < 8
        assert not receiver.poll().finished_receiving
        sender.forget("x")
        receiver.cancel("x")
        receiver.poll()
        receiver.forget("x")
        assert sender.num_records() == 0 and receiver.num_records() == 0
    finally:
        sender.close()
        receiver.close()
        del pool


def test_tls_stream_survives_a_reader_and_writers_at_once() -> None:
    """One thread reads while two write on the same connection, both ways: the use that
    corrupts a Python ``SSLSocket``; every byte arrives, in order per writer."""
    server = socket.create_server(("127.0.0.1", 0))
    client_raw = socket.create_connection(server.getsockname())
    server_raw, _ = server.accept()
    for s in (client_raw, server_raw):
        s.settimeout(10)
    done: list[TlsStream] = []
    th = threading.Thread(target=lambda: done.append(TlsStream.wrap(server_raw, TLS.server_context(), True)))
    th.start()
    client = TlsStream.wrap(client_raw, TLS.client_context(), False)
    th.join()
    [srv] = done
    size, rounds = 50_000, 40
    lock = threading.Lock()

    def writer(stream: TlsStream, tag: int) -> None:
        for i in range(rounds):
            with lock:  # channels serialize their writers
                stream.sendall(bytes([tag, i]) * (size // 2))

    def reader(stream: TlsStream, got: bytearray) -> None:
        buf = bytearray(1 << 16)
        while len(got) < 2 * rounds * size:
            n = stream.recv_into(buf)
            assert n > 0
            got += buf[:n]

    got_srv, got_cli = bytearray(), bytearray()
    threads = [
        threading.Thread(target=writer, args=(client, 1)),
        threading.Thread(target=writer, args=(client, 2)),
        threading.Thread(target=writer, args=(srv, 3)),
        threading.Thread(target=writer, args=(srv, 4)),
        threading.Thread(target=reader, args=(srv, got_srv)),
        threading.Thread(target=reader, args=(client, got_cli)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for got, tags in ((got_srv, (1, 2)), (got_cli, (3, 4))):
        assert len(got) == 2 * rounds * size
        chunks = [bytes(got[i : i + size]) for i in range(0, len(got), size)]
        for tag in tags:
            mine = [c for c in chunks if c[0] == tag]
            assert mine == [bytes([tag, i]) * (size // 2) for i in range(rounds)]
    client.close()
    srv.close()
    server.close()


def test_unusable_material_is_a_clear_error() -> None:
    with pytest.raises(InternalTlsError, match="internal TLS"):
        InternalTls(TLS.ca_pem, TLS.cert_pem, InternalTls.generate().key_pem).server_context()
    assert "PRIVATE" not in repr(TLS) and "BEGIN" not in repr(TLS)
