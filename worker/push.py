"""Worker side of the worker channel: one TCP connection to the router that carries this
worker's output batches (one frame per collect) and, the other way, the router's commands and
their answers.

Why not Ray calls: a round trip through Ray costs about a millisecond on a busy host, paid on
every request's first token and decode step; a socket write costs tens of microseconds, and
the connection's end-of-file tells the router at once that this process died. Commands on one
connection also arrive in the order the router sent them, so an abort never overtakes the
command that added its request.

Handshake: the router sends a challenge; the worker answers with its id, the HMAC of the
challenge and a challenge of its own; the router answers that with its HMAC (``welcome``).
Only then does the worker send outputs or accept commands: a peer that cannot prove the
cluster secret gets nothing and commands nothing.

Threads: the pusher (batches), the command reader, and the answer sender; the two writers
share one lock, so frames never interleave. A malformed command frame is answered with an
error (or, without a readable call id, dropped) and the worker keeps serving; only a broken
frame length, which leaves the stream unreadable, ends the connection.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from pdserve.kvtransfer.tls import InternalTls, TlsStream
from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.worker.codec import (
    CHALLENGE_BYTES,
    LENGTH,
    MAX_HELLO_BYTES,
    ChannelError,
    check_welcome,
    encode_batch,
    encode_hello,
)
from pdserve.worker.command_codec import (
    MAX_COMMAND_BYTES,
    CommandFrameError,
    decode_command,
    encode_answer,
    encode_error,
)
from pdserve.worker.commands import Answer, Command, CommandError, ErrorKind, UnsupportedCommand
from pdserve.worker.loop import EngineLoop, WorkerFailed
from pdserve.worker.messages import OutputBatch, TokenDelta, WorkerLoad

log = logging.getLogger(__name__)
Stream = socket.socket | TlsStream  # the channel, plain or over the deployment's TLS

HEARTBEAT_S = 0.5  # an idle worker still reports its load this often
CONNECT_TIMEOUT_S = 30.0
HANDSHAKE_TIMEOUT_S = 10.0

Execute = Callable[[Command], "Future[Answer]"]
_Outcome = tuple[int, "Future[Answer] | CommandError"]  # (call id, what answers it)


def recv_exact(sock: Stream, n: int) -> bytes:
    """``n`` bytes from ``sock``; ``ConnectionError`` if it closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the router closed the worker channel")
        buf += chunk
    return bytes(buf)


def _read_frame(sock: Stream, limit: int) -> bytes:
    (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    if not 0 < n <= limit:
        raise ChannelError(f"frame length {n} outside 1..{limit}")
    return recv_exact(sock, n)


def _hang_up(sock: Stream) -> None:
    """Close for good: ``shutdown`` first, so the peer sees the end at once and a thread
    blocked reading this socket wakes up (a bare ``close`` does neither while it reads)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def error_of(e: BaseException) -> CommandError:
    """How a command's exception reaches the router: the request's fault or the worker's."""
    if isinstance(e, InvalidRequestError):
        return CommandError(ErrorKind.INVALID, e.message, e.field)
    if isinstance(e, UnsupportedCommand):
        return CommandError(ErrorKind.UNSUPPORTED, str(e))
    if isinstance(e, ValueError):
        return CommandError(ErrorKind.VALUE, str(e))
    return CommandError(ErrorKind.FAILED, f"{type(e).__name__}: {e}")


class OutputPusher:
    def __init__(
        self,
        loop: EngineLoop,
        load: Callable[[], WorkerLoad],
        worker_id: str,
        address: str,
        secret: bytes,
        execute: Execute,
        tls: InternalTls | None = None,
    ) -> None:
        self.loop = loop
        self.load = load
        self.worker_id = worker_id
        self.address = address
        self.secret = secret
        self.execute = execute
        self.tls = tls
        self.bad_commands = 0  # malformed command frames answered or dropped
        self._stop = threading.Event()
        self._router_closed = threading.Event()
        self._sock: Stream | None = None
        self._send_lock = threading.Lock()
        self._answers: queue.SimpleQueue[_Outcome | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="output-push", daemon=True)
        self._thread.start()

    def _connect(self) -> Stream:
        """The authenticated channel to the router. A refused connection, or one the router
        closed or reset before the handshake was done (a router still starting, or shedding
        connections that have not authenticated under a flood), is made again, backing off,
        within ``CONNECT_TIMEOUT_S``; a router that cannot prove the secret is final."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        delay = 0.05
        while True:
            try:
                return self._connect_once()
            except OSError as e:  # (ConnectionError included: closed or reset mid-handshake)
                refused_tls = isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLEOFError)
                if refused_tls or time.monotonic() + delay > deadline or self._stop.is_set():
                    raise
                log.debug("worker channel to %s: %s; again in %g s", self.address, e, delay)
            time.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _connect_once(self) -> Stream:
        host, _, port = self.address.rpartition(":")
        raw = socket.create_connection((host, int(port)), timeout=5)
        sock: Stream = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.settimeout(HANDSHAKE_TIMEOUT_S)
            if self.tls is not None:
                sock = TlsStream.wrap(raw, self.tls.client_context(), server_side=False)
            challenge = recv_exact(sock, CHALLENGE_BYTES)
            nonce = os.urandom(CHALLENGE_BYTES)
            sock.sendall(encode_hello(self.worker_id, self.secret, challenge, nonce))
            check_welcome(_read_frame(sock, MAX_HELLO_BYTES), self.secret, nonce, self.worker_id)
            sock.settimeout(None)
        except BaseException:
            _hang_up(sock)  # an unproven router gets nothing, not even a dangling connection
            raise
        return sock

    def _send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            return
        with self._send_lock:
            sock.sendall(data)

    def _send_deltas(self, deltas: list[TokenDelta], first: bool = False) -> None:
        # The prefix cache's changes ride along; a new connection's first batch replaces the
        # router's view with a snapshot (taken after this take: it has those ops in it).
        kv = self.loop.take_kv_events()
        if first:
            kv = self.loop.kv_snapshot()
        self._send(encode_batch(self.worker_id, OutputBatch(tuple(deltas), self.load(), kv)))

    def _run(self) -> None:
        try:
            self._sock = sock = self._connect()
            threading.Thread(
                target=self._read_commands, args=(sock,), name="worker-commands", daemon=True
            ).start()
            threading.Thread(target=self._send_answers, name="worker-answers", daemon=True).start()
            first = True
            while not self._stop.is_set():
                try:
                    deltas = self.loop.collect(HEARTBEAT_S)
                except WorkerFailed:
                    return  # the loop died: closing the socket tells the router
                self._send_deltas(deltas, first)
                first = False
            # Stopping: what the engine produced since the last batch still goes out — a drained
            # worker's last deltas end the requests the drain waited for, and a router that
            # never got them would move those requests as if the worker had died under them.
            with contextlib.suppress(WorkerFailed):
                if deltas := self.loop.collect(0.0):
                    self._send_deltas(deltas)
        except BaseException as e:
            if not self._stop.is_set():
                self.error = e
                if self._router_closed.is_set():  # the router went first (it stops, or let us go)
                    log.info("the router closed the worker channel")
                else:
                    log.error("worker channel to %s failed: %s", self.address, e)
        finally:
            self._answers.put(None)
            if self._sock is not None:
                _hang_up(self._sock)

    # -- commands ----------------------------------------------------------------------------
    def _read_commands(self, sock: Stream) -> None:
        try:
            while not self._stop.is_set():
                body = _read_frame(sock, MAX_COMMAND_BYTES)
                try:
                    call_id, cmd = decode_command(body)
                except CommandFrameError as e:
                    self.bad_commands += 1
                    self._answers.put((e.call_id, CommandError(ErrorKind.VALUE, f"bad command: {e}")))
                    continue
                except ChannelError as e:  # no call id to answer: nobody waits for it
                    self.bad_commands += 1
                    log.debug("dropped a malformed command frame: %s", e)
                    continue
                outcome = self._run_command(cmd)
                if isinstance(outcome, Future):
                    # Answered when done (an awaited reservation may take seconds): the
                    # answers of the commands behind it never wait for it.
                    outcome.add_done_callback(functools.partial(self._done, call_id))
                else:
                    self._answers.put((call_id, outcome))
        except Exception as e:  # unreadable stream, or a bug: never a reader dead behind a live socket
            if isinstance(e, ConnectionError):
                self._router_closed.set()
            if not self._stop.is_set():
                log.info("worker channel closed while reading commands: %r", e)
                _hang_up(sock)  # the router must see the loss

    def _run_command(self, cmd: Command) -> Future[Answer] | CommandError:
        try:
            return self.execute(cmd)
        except BaseException as e:  # refused before it was queued (loop stopped, wrong role)
            return error_of(e)

    def _done(self, call_id: int, fut: Future[Answer]) -> None:
        self._answers.put((call_id, fut))

    def _send_answers(self) -> None:
        """Sends each answer once its command is done, off the engine's thread (a slow
        router must never stall a step)."""
        while True:
            item = self._answers.get()
            if item is None:
                return
            call_id, outcome = item
            if isinstance(outcome, Future):
                try:
                    data = encode_answer(call_id, outcome.result())
                except BaseException as e:
                    data = encode_error(call_id, error_of(e))
            else:
                data = encode_error(call_id, outcome)
            try:
                self._send(data)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S + 1)
