"""Worker side of the output channel: one TCP connection to the router, one frame per collect.

Why not a Ray call per batch: a long-poll round trip through Ray costs about a millisecond on
a busy host, paid once per decode step and once on every request's first token. A socket
write costs tens of microseconds, and its end-of-file tells the router at once that this
process died.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from pdserve.worker.codec import CHALLENGE_BYTES, encode_batch, encode_hello
from pdserve.worker.loop import EngineLoop, WorkerFailed
from pdserve.worker.messages import OutputBatch, WorkerLoad

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # an idle worker still reports its load this often
CONNECT_TIMEOUT_S = 30.0


class OutputPusher:
    def __init__(
        self,
        loop: EngineLoop,
        load: Callable[[], WorkerLoad],
        worker_id: str,
        address: str,
        secret: bytes,
    ) -> None:
        self.loop = loop
        self.load = load
        self.worker_id = worker_id
        self.address = address
        self.secret = secret
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="output-push", daemon=True)
        self._thread.start()

    def _connect(self) -> socket.socket:
        host, _, port = self.address.rpartition(":")
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                time.sleep(0.1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        challenge = b""
        while len(challenge) < CHALLENGE_BYTES:
            chunk = sock.recv(CHALLENGE_BYTES - len(challenge))
            if not chunk:
                raise ConnectionError("router closed the output channel during the handshake")
            challenge += chunk
        sock.sendall(encode_hello(self.worker_id, self.secret, challenge))
        sock.settimeout(None)
        return sock

    def _run(self) -> None:
        try:
            self._sock = sock = self._connect()
            while not self._stop.is_set():
                try:
                    deltas = self.loop.collect(HEARTBEAT_S)
                except WorkerFailed:
                    return  # the loop died: closing the socket tells the router
                sock.sendall(encode_batch(self.worker_id, OutputBatch(tuple(deltas), self.load())))
        except BaseException as e:
            if not self._stop.is_set():
                log.error("output channel to %s failed: %s", self.address, e)
                self.error = e
        finally:
            if self._sock is not None:
                self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S + 1)
