"""Router side of the worker channel: every worker connects here over TCP; its output batches
and its answers to commands come in, the router's commands go out (``pdserve.worker.push``
is the other end, ``pdserve.worker.commands`` the command contract).

Each connection authenticates both ways (HMAC of a fresh challenge with the cluster secret,
each side challenging the other) as one of the expected workers; after that every frame from
the worker is an ``OutputBatch`` or an answer. A connection that ends while the router is
running means the worker is gone: its requests fail at once, and so do its commands still
waiting for answers (no waiting for a call to time out).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable

from pdserve.kvtransfer.admission import PendingConnections
from pdserve.kvtransfer.tls import InternalTls
from pdserve.router.tls_front import peer_address
from pdserve.router.workers import WorkerHandle, WorkerLost
from pdserve.worker.codec import (
    CHALLENGE_BYTES,
    LENGTH,
    MAX_FRAME_BYTES,
    MAX_HELLO_BYTES,
    ChannelError,
    decode_hello,
    encode_welcome,
)
from pdserve.worker.command_codec import decode_from_worker, encode_command
from pdserve.worker.commands import Answer, Command, CommandError
from pdserve.worker.messages import KvEvents, OutputBatch, TokenDelta, WorkerInfo

log = logging.getLogger(__name__)

OnDeltas = Callable[[WorkerHandle, tuple[TokenDelta, ...]], None]
OnLost = Callable[[WorkerHandle, str], Awaitable[None]]
OnPoolChange = Callable[[WorkerHandle], None]
OnJoin = Callable[[WorkerInfo], None]
OnSwitch = Callable[[WorkerHandle, WorkerInfo], None]
OnKv = Callable[[WorkerHandle, KvEvents], None]
HANDSHAKE_TIMEOUT_S = 5.0  # an unauthenticated connection's set-up (TLS, then the hello)
REGISTER_TIMEOUT_S = 60.0  # a worker started at run time waits this long to be registered
MAX_CHANNELS = 4096  # authenticated workers connected at once; more are refused


class CommandChannel:
    """The router's end of one worker's commands: each ``send`` gets a call id and a future
    that its answer resolves; the connection's end fails every command still waiting."""

    def __init__(self, worker_id: str, writer: asyncio.StreamWriter) -> None:
        self.worker_id = worker_id
        self._writer = writer
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[Answer]] = {}
        self._closed: str | None = None

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def send(self, cmd: Command) -> asyncio.Future[Answer]:
        if self._closed is not None:
            raise WorkerLost(f"worker {self.worker_id}: {self._closed}")
        self._next_id += 1
        call_id = self._next_id
        fut: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        fut.add_done_callback(lambda _: self._pending.pop(call_id, None))  # answered, timed out
        self._writer.write(encode_command(call_id, cmd))
        return fut

    def answered(self, call_id: int, outcome: Answer | CommandError) -> None:
        fut = self._pending.pop(call_id, None)
        if fut is None or fut.done():
            return  # its caller gave up
        if isinstance(outcome, CommandError):
            lost = WorkerLost(f"worker {self.worker_id}: {outcome.kind.value}: {outcome.message}")
            fut.set_exception(outcome.request_fault() or lost)
        else:
            fut.set_result(outcome)

    def close(self, reason: str) -> None:
        self._closed = reason
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(WorkerLost(f"worker {self.worker_id}: {reason}"))
        self._pending.clear()


class OutputListener:
    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        liveness_timeout_s: float = 4.0,
        tls: InternalTls | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        """``sock``: a listening socket to serve (a router replica's, which its pool owner
        bound and keeps, so a restarted replica is found at the same address); else one is
        bound to ``host:port`` by ``start``."""
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        self.secret = secret
        self.tls = tls  # set: workers connect over TLS with the deployment's certificate
        self.host = host
        self.port = port
        self.sock = sock
        # A live worker sends a frame at least every HEARTBEAT_S (``pdserve.worker.push``); one
        # silent this long is stopped or wedged (SIGSTOP, a stuck process): it is lost.
        self.liveness_timeout_s = liveness_timeout_s
        self._server: asyncio.Server | None = None
        self._workers: dict[str, WorkerHandle] = {}
        self._on_deltas: OnDeltas | None = None
        self._on_lost: OnLost | None = None
        self._on_pool_change: OnPoolChange | None = None
        self._on_join: OnJoin | None = None
        self.on_kv: OnKv | None = None  # set: where each batch's prefix-cache events go
        self._bound = asyncio.Event()
        self._connected: dict[str, asyncio.Event] = {}
        self._registered: dict[str, asyncio.Event] = {}  # workers started after ``bind``
        self._closing = False
        self._writers: set[asyncio.StreamWriter] = set()  # every open connection
        # Connections that have not authenticated: bounded, the oldest shed for a new one.
        self._pending: PendingConnections[asyncio.StreamWriter] = PendingConnections()

    async def start(self) -> str:
        context = self.tls.server_context() if self.tls is not None else None
        handshake = HANDSHAKE_TIMEOUT_S if context is not None else None
        if self.sock is not None:
            self._server = await asyncio.start_server(
                self._serve, sock=self.sock, ssl=context, ssl_handshake_timeout=handshake
            )
        else:
            self._server = await asyncio.start_server(
                self._serve, self.host, self.port, ssl=context, ssl_handshake_timeout=handshake
            )
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host if self.sock is not None else self.host}:{port}"

    def bind(
        self,
        workers: dict[str, WorkerHandle],
        on_deltas: OnDeltas,
        on_lost: OnLost,
        on_pool_change: OnPoolChange,
        on_join: OnJoin | None = None,
        on_switch: OnSwitch | None = None,
    ) -> None:
        """Start delivering: connections that arrived earlier wait for this. ``on_pool_change``:
        whether a worker takes requests changed (its channel came up, or it reports draining).
        ``on_join`` (a router replica's): takes in a worker this router was not told of, from
        the info frame it sends first (raises ``ValueError`` to refuse it), and ``on_switch``
        hears of a worker's new role from the info frame it sends after a switch."""
        self._workers, self._on_deltas, self._on_lost = workers, on_deltas, on_lost
        self._on_pool_change = on_pool_change
        self._on_join = on_join
        self._on_switch = on_switch or (lambda w, info: None)
        self._bound.set()

    def expect(self, worker_id: str) -> None:
        """A worker is being started at run time: its connection waits (instead of being
        refused) until ``registered`` says the router knows it."""
        self._registered.setdefault(worker_id, asyncio.Event())

    def registered(self, worker_id: str) -> None:
        self._registered.setdefault(worker_id, asyncio.Event()).set()

    def forget(self, worker_id: str) -> None:
        """A worker that will not connect again (lost, or its start failed)."""
        self._registered.pop(worker_id, None)
        self._connected.pop(worker_id, None)

    async def wait_connected(self, worker_ids: list[str], timeout_s: float) -> None:
        events = [self._connected.setdefault(w, asyncio.Event()) for w in worker_ids]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout_s)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        worker: WorkerHandle | None = None
        channel: CommandChannel | None = None
        reason = "output channel closed"
        peer = peer_address(writer)
        # What a timeout here means: what the channel was waiting for when it ran out.
        waiting = f"no hello from {peer} within {HANDSHAKE_TIMEOUT_S:g} s"
        self._writers.add(writer)
        for old in self._pending.admit(writer, peer.rpartition(":")[0]):
            log.info("worker channel: %s had not authenticated; closed for a newer connection",
                     peer_address(old))  # fmt: skip
            old.close()  # its read of the hello ends
        try:
            challenge = os.urandom(CHALLENGE_BYTES)
            writer.write(challenge)
            body = await asyncio.wait_for(_read_frame(reader, MAX_HELLO_BYTES), HANDSHAKE_TIMEOUT_S)
            wid, nonce = decode_hello(body, self.secret, challenge)
            self._pending.settled(writer)
            if len(self._writers) - len(self._pending) > MAX_CHANNELS:
                raise ChannelError(f"more than {MAX_CHANNELS} workers connected")
            writer.write(encode_welcome(self.secret, nonce, wid))
            await self._bound.wait()
            known = self._workers.get(wid)
            if self._on_join is not None and (known is None or not known.alive):
                # A router replica takes in whichever worker proves the secret: the pool owner
                # started it, and its first frame says what it is.
                waiting = f"no info frame from worker {wid!r} ({peer}) within {HANDSHAKE_TIMEOUT_S:g} s"
                body = await asyncio.wait_for(_read_frame(reader, MAX_FRAME_BYTES), HANDSHAKE_TIMEOUT_S)
                info = decode_from_worker(body, wid)
                if not isinstance(info, WorkerInfo):
                    raise ChannelError(f"worker {wid!r} sent no info frame first")
                try:
                    self._on_join(info)
                except ValueError as e:
                    raise ChannelError(str(e)) from None
            elif wid not in self._workers and wid in self._registered:
                waiting = f"worker {wid!r} ({peer}) was not registered within {REGISTER_TIMEOUT_S:g} s"
                await asyncio.wait_for(self._registered[wid].wait(), REGISTER_TIMEOUT_S)
            worker = self._workers.get(wid)
            if worker is None:
                raise ChannelError(f"unexpected worker {wid!r}")
            if not worker.alive or worker.channel is not None:
                # A lost worker stays lost (its requests moved on), and one worker has one channel.
                raise ChannelError(f"worker {wid!r} is fenced off (lost, or already connected)")
            worker.channel = channel = CommandChannel(wid, writer)
            self._connected.setdefault(wid, asyncio.Event()).set()
            assert self._on_deltas is not None and self._on_pool_change is not None
            self._on_pool_change(worker)
            while True:
                try:
                    body = await asyncio.wait_for(
                        _read_frame(reader, MAX_FRAME_BYTES), self.liveness_timeout_s
                    )
                except asyncio.TimeoutError:
                    reason = f"no frame for {self.liveness_timeout_s:g} s (stopped or wedged)"
                    break
                frame = decode_from_worker(body, wid)
                if isinstance(frame, WorkerInfo):
                    # A replica learns a role switch here; the owner, who switched it, knows.
                    if self._on_join is not None and frame.role is not worker.role:
                        self._on_switch(worker, frame)
                    continue
                if not isinstance(frame, OutputBatch):
                    channel.answered(*frame)
                    continue
                was = worker.health
                worker.report(frame.load)
                if frame.kv is not None and self.on_kv is not None:
                    self.on_kv(worker, frame.kv)
                if worker.health is not was:
                    self._on_pool_change(worker)
                if frame.deltas:
                    self._on_deltas(worker, frame.deltas)
                    await asyncio.sleep(0)  # let streams send what arrived before reading on
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError) as e:
            reason = f"output channel closed ({type(e).__name__})"
        except ChannelError as e:
            reason = f"output channel from {peer} refused: {e}"
            log.warning("%s", reason)
        except asyncio.TimeoutError:  # (here: the handshake's, or the registration's)
            reason = f"output channel refused: {waiting}"
            log.warning("%s", reason)
        finally:
            self._writers.discard(writer)
            self._pending.settled(writer)
            writer.close()
            if channel is not None:
                channel.close(reason)
            if worker is not None and not self._closing and worker.alive and self._on_lost is not None:
                log.error("worker %s lost: %s", worker.worker_id, reason)
                worker.mark_lost()
                await self._on_lost(worker, reason)

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            await self._server.wait_closed()


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if not 0 < n <= limit:
        raise ChannelError(f"frame length {n} outside 1..{limit}")
    return await reader.readexactly(n)
