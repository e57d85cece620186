"""Router side of the output channel: every worker pushes its output batches here over TCP.

Each connection authenticates (HMAC of a fresh challenge with the cluster secret) as one of
the expected workers; after that every frame is one ``OutputBatch`` for the router. A
connection that ends while the router is running means the worker is gone: its requests fail
at once (no waiting for a call to time out).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable

from pdserve.router.workers import WorkerHandle
from pdserve.worker.codec import (
    CHALLENGE_BYTES,
    LENGTH,
    MAX_FRAME_BYTES,
    MAX_HELLO_BYTES,
    ChannelError,
    decode_batch,
    decode_hello,
)
from pdserve.worker.messages import TokenDelta

log = logging.getLogger(__name__)

OnDeltas = Callable[[WorkerHandle, tuple[TokenDelta, ...]], None]
OnLost = Callable[[WorkerHandle, str], Awaitable[None]]
HANDSHAKE_TIMEOUT_S = 10.0


class OutputListener:
    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        self.secret = secret
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._workers: dict[str, WorkerHandle] = {}
        self._on_deltas: OnDeltas | None = None
        self._on_lost: OnLost | None = None
        self._bound = asyncio.Event()
        self._connected: dict[str, asyncio.Event] = {}
        self._closing = False
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        return f"{self.host}:{port}"

    def bind(self, workers: dict[str, WorkerHandle], on_deltas: OnDeltas, on_lost: OnLost) -> None:
        """Start delivering: connections that arrived earlier wait for this."""
        self._workers, self._on_deltas, self._on_lost = workers, on_deltas, on_lost
        self._bound.set()

    async def wait_connected(self, worker_ids: list[str], timeout_s: float) -> None:
        events = [self._connected.setdefault(w, asyncio.Event()) for w in worker_ids]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout_s)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        worker: WorkerHandle | None = None
        reason = "output channel closed"
        self._writers.add(writer)
        try:
            challenge = os.urandom(CHALLENGE_BYTES)
            writer.write(challenge)
            body = await asyncio.wait_for(_read_frame(reader, MAX_HELLO_BYTES), HANDSHAKE_TIMEOUT_S)
            wid = decode_hello(body, self.secret, challenge)
            self._connected.setdefault(wid, asyncio.Event()).set()
            await self._bound.wait()
            worker = self._workers.get(wid)
            if worker is None:
                raise ChannelError(f"unexpected worker {wid!r}")
            assert self._on_deltas is not None
            while True:
                batch = decode_batch(await _read_frame(reader, MAX_FRAME_BYTES), wid)
                worker.load = batch.load
                if batch.deltas:
                    self._on_deltas(worker, batch.deltas)
                    await asyncio.sleep(0)  # let streams send what arrived before reading on
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            reason = f"output channel closed ({type(e).__name__})"
        except (ChannelError, asyncio.TimeoutError) as e:
            reason = f"output channel refused: {e}"
            log.warning("%s", reason)
        finally:
            self._writers.discard(writer)
            writer.close()
            if worker is not None and not self._closing and worker.healthy and self._on_lost is not None:
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
