"""A live worker behind its command channel, driven by a hand-written router end: over 1,000
hostile command frames are refused while the worker keeps serving, commands run in the order
sent, and a peer that cannot prove the cluster secret gets no output and runs no command."""

from __future__ import annotations

import os
import pickle
import random
import socket
from collections.abc import Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from pdserve.decode_worker.actor import DecodeWorker
from pdserve.kvtransfer.config import TransportConfig
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.worker.codec import CHALLENGE_BYTES, LENGTH, VERSION, decode_hello, encode_welcome
from pdserve.worker.command_codec import decode_from_worker, encode_command
from pdserve.worker.commands import Abort, AddLocal, KvLost, QueueReservation
from pdserve.worker.link import recv_exact
from pdserve.worker.messages import WorkerRole, WorkItem
from pdserve.worker.spec import WorkerSpec

SECRET = b"channel-test-secret-0123"
TCP = TransportConfig(backend="tcp")
ENGINE = EngineConfig(
    model="tiny", cache=CacheConfig(block_size=8, num_blocks=64), scheduler=SchedulerConfig(64, 8)
)


class FakeRouter:
    """The router's end of one worker channel, by hand."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.conn: socket.socket | None = None

    def accept(self, secret: bytes = SECRET) -> str:
        self.server.settimeout(30)
        conn, _ = self.server.accept()
        conn.settimeout(30)
        challenge = os.urandom(CHALLENGE_BYTES)
        conn.sendall(challenge)
        wid, nonce = decode_hello(self._read(conn), SECRET, challenge)
        conn.sendall(encode_welcome(secret, nonce, wid))
        self.conn = conn
        return wid

    @staticmethod
    def _read(conn: socket.socket) -> bytes:
        (n,) = LENGTH.unpack(recv_exact(conn, LENGTH.size))
        return recv_exact(conn, n)

    def send_raw(self, body: bytes) -> None:
        assert self.conn is not None
        self.conn.sendall(LENGTH.pack(len(body)) + body)

    def answer(self, call_id: int) -> Any:
        """Read frames until the answer to ``call_id`` (output batches are skipped)."""
        assert self.conn is not None
        while True:
            frame = decode_from_worker(self._read(self.conn), "d0")
            if isinstance(frame, tuple) and frame[0] == call_id:
                return frame[1]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()


@pytest.fixture
def channel() -> Iterator[tuple[FakeRouter, DecodeWorker]]:
    router = FakeRouter()
    spec = WorkerSpec(
        "d0", WorkerRole.DECODE, ENGINE, TransportConfig(backend="tcp"), SECRET, router_address=router.address
    )
    worker = DecodeWorker(spec)
    try:
        assert router.accept() == "d0"
        yield router, worker
        assert worker.wait_idle(5.0)
        worker.check_integrity()
    finally:
        worker.shutdown()
        router.close()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def hostile_bodies(n: int, seed: int = 0) -> list[bytes]:
    """Malformed command bodies of every kind, each with a valid length prefix."""
    rng = random.Random(seed)
    good = msgpack.packb({"v": VERSION, "c": 1, "k": "kv_lost", "a": ["r"]}, use_bin_type=True)
    kinds = ["prefill", "set_target", "queue_reservation", "await_reservation", "start", "kv_lost",
             "add_local", "abort", "shutdown", "", "eval"]  # fmt: skip
    junk: list[Any] = [None, True, -1, 1 << 62, 1.5, float("nan"), "x" * 300, b"\x00", [], {}, [[[[[[1]]]]]]]
    out = []
    for i in range(n):
        r = i % 6
        if r == 0:  # random bytes
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
        elif r == 1:  # a good frame, truncated or with flipped bytes
            b = bytearray(good)
            if rng.random() < 0.5:
                b = b[: rng.randrange(1, len(b))]
            else:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            out.append(bytes(b))
        elif r == 2:  # wrong argument types and counts
            args = [rng.choice(junk) for _ in range(rng.randrange(0, 4))]
            out.append(
                msgpack.packb({"v": VERSION, "c": i, "k": rng.choice(kinds), "a": args}, use_bin_type=True)
            )
        elif r == 3:  # pickle payloads
            out.append(pickle.dumps({"v": VERSION, "c": i, "k": "abort", "a": ["r"]}))
        elif r == 4:  # deep nesting
            deep: Any = 1
            for _ in range(rng.randrange(10, 200)):
                deep = [deep]
            out.append(
                msgpack.packb({"v": VERSION, "c": i, "k": "add_local", "a": [deep]}, use_bin_type=True)
            )
        else:  # wrong keys and versions
            out.append(
                msgpack.packb({"v": rng.choice([0, 1, 2, 99]), "c": i, "k": "abort", "a": ["r"], "z": 1})
            )
    return out


def test_a_thousand_hostile_command_frames_leave_the_worker_serving(channel) -> None:
    router, worker = channel
    for raw in hostile_bodies(1200):
        router.send_raw(raw)
    # Still serving, on the same connection: a real command after the storm is answered (and,
    # commands running in order, only after every hostile frame was dealt with).
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    router.send_raw(encode_command(10_001, AddLocal(WorkItem("real", (5, 6, 7), params)))[LENGTH.size :])
    assert router.answer(10_001) is None
    assert worker.pusher is not None and worker.pusher.bad_commands >= 1100  # a flipped bit may still parse
    assert worker.wait_idle(10.0)  # it ran to the end


def test_commands_run_in_the_order_sent(channel) -> None:
    """Queue then abort in one burst: the abort never overtakes the reservation it cancels."""
    router, _ = channel
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    work = WorkItem("q", tuple(range(1, 20)), params)
    router.send_raw(encode_command(1, QueueReservation(work, "t-q", 5.0))[LENGTH.size :])
    router.send_raw(encode_command(2, KvLost("q"))[LENGTH.size :])
    router.send_raw(encode_command(3, Abort("q"))[LENGTH.size :])
    assert router.answer(1) is True
    assert router.answer(2) is True  # the reservation existed when kv_lost came
    assert router.answer(3) is True  # ... and when the abort came


def test_a_router_that_cannot_prove_the_secret_gets_nothing() -> None:
    router = FakeRouter()
    spec = WorkerSpec(
        "d0", WorkerRole.DECODE, ENGINE, TransportConfig(backend="tcp"), SECRET, router_address=router.address
    )
    worker = DecodeWorker(spec)
    try:
        router.accept(secret=b"not-the-cluster-secret-!")
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        router.send_raw(encode_command(1, AddLocal(WorkItem("intruder", (5, 6), params)))[LENGTH.size :])
        assert router.conn is not None
        router.conn.settimeout(5)
        assert router.conn.recv(1 << 16) == b""  # hung up: no answer, no output batch
        assert worker.request_state()["requests"] == 0
    finally:
        worker.shutdown()
        router.close()
