"""One connection of a worker's channel to one router (``pdserve.worker.push`` runs one per
router: the pool owner's, and each router replica's).

Handshake: the router sends a challenge; the worker answers with its id, the HMAC of the
challenge and a challenge of its own; the router answers that with its HMAC (``welcome``).
Only then does the worker send anything (its ``WorkerInfo`` first, ``info_codec``) or take
commands: a peer that cannot prove the cluster secret gets nothing and commands nothing.

Threads: the command reader and the answer sender, per connection; frames are written under
one lock, so they never interleave. A malformed command frame is answered with an error (or,
without a readable call id, dropped) and the connection stays up; only a broken frame length,
which leaves the stream unreadable, ends it. ``closed`` is set once the connection ended,
whichever side ended it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import socket
import ssl
import struct
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

log = logging.getLogger(__name__)
Stream = socket.socket | TlsStream  # the channel, plain or over the deployment's TLS

HANDSHAKE_TIMEOUT_S = 10.0

# Runs a command the reader decoded: its answer's future, or the error at once.
OnCommand = Callable[["Link", Command], "Future[Answer] | CommandError"]


def recv_exact(sock: Stream, n: int) -> bytes:
    """``n`` bytes from ``sock``; ``ConnectionError`` if it closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the router closed the worker channel")
        buf += chunk
    return bytes(buf)


def read_frame(sock: Stream, limit: int) -> bytes:
    (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    if not 0 < n <= limit:
        raise ChannelError(f"frame length {n} outside 1..{limit}")
    return recv_exact(sock, n)


def hang_up(sock: Stream) -> None:
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


def connect(
    address: str, worker_id: str, secret: bytes, tls: InternalTls | None, send_timeout_s: float = 0.0
) -> Stream:
    """The authenticated connection to the router at ``address`` (one try). ``send_timeout_s``
    (> 0): a write that cannot go on for that long fails instead of blocking (a wedged router
    must not stall the worker's other routers)."""
    host, _, port = address.rpartition(":")
    raw = socket.create_connection((host, int(port)), timeout=5)
    sock: Stream = raw
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.settimeout(HANDSHAKE_TIMEOUT_S)
        if tls is not None:
            sock = TlsStream.wrap(raw, tls.client_context(), server_side=False)
        challenge = recv_exact(sock, CHALLENGE_BYTES)
        nonce = os.urandom(CHALLENGE_BYTES)
        sock.sendall(encode_hello(worker_id, secret, challenge, nonce))
        check_welcome(read_frame(sock, MAX_HELLO_BYTES), secret, nonce, worker_id)
        sock.settimeout(None)
        if send_timeout_s > 0:
            secs = int(send_timeout_s)
            raw.setsockopt(
                socket.SOL_SOCKET,
                socket.SO_SNDTIMEO,
                struct.pack("ll", secs, int((send_timeout_s - secs) * 1e6)),
            )
    except BaseException:
        hang_up(sock)  # an unproven router gets nothing, not even a dangling connection
        raise
    return sock


def refused_for_good(e: OSError) -> bool:
    """A TLS refusal (not a connection cut mid-handshake): trying again cannot help."""
    return isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLEOFError)


def connect_retrying(
    address: str, worker_id: str, secret: bytes, tls: InternalTls | None, deadline: float,
    stop: threading.Event, send_timeout_s: float = 0.0, max_delay_s: float = 1.0,
) -> Stream:  # fmt: skip
    """``connect``, again with back-off while the router refuses or closes the connection
    before the handshake is done (a router still starting, or shedding connections that have
    not authenticated under a flood), until ``deadline`` (monotonic) or ``stop``; a router
    that cannot prove the secret is final."""
    delay = 0.05
    while True:
        try:
            return connect(address, worker_id, secret, tls, send_timeout_s)
        except OSError as e:  # (ConnectionError included: closed or reset mid-handshake)
            if refused_for_good(e) or time.monotonic() + delay > deadline or stop.is_set():
                raise
            log.debug("worker channel to %s: %s; again in %g s", address, e, delay)
        if stop.wait(delay):
            raise ConnectionAbortedError("the worker is stopping")
        delay = min(2 * delay, max_delay_s)


class Link:
    """One live, authenticated connection to one router: reads its commands (each handed to
    ``on_command``, in arrival order), sends their answers when done and whatever frames the
    worker writes. ``index`` names the router (0: the pool owner)."""

    def __init__(self, index: int, address: str, sock: Stream, on_command: OnCommand) -> None:
        self.index = index
        self.address = address
        self.sock = sock
        self.on_command = on_command
        self.bad_commands = 0  # malformed command frames answered or dropped
        self.closed = threading.Event()
        self.router_closed = False  # the router ended it (not a write that failed here)
        self._send_lock = threading.Lock()
        self._answers: queue.SimpleQueue[tuple[int, Future[Answer] | CommandError] | None] = (
            queue.SimpleQueue()
        )
        self.last_sent = 0.0  # monotonic time of the last frame written
        self.fresh = True  # no output batch sent yet: its first carries a prefix-cache snapshot
        threading.Thread(target=self._read_commands, name=f"worker-commands-{index}", daemon=True).start()
        threading.Thread(target=self._send_answers, name=f"worker-answers-{index}", daemon=True).start()

    def send(self, data: bytes) -> None:
        """Write one frame; ``OSError`` (the connection is then closed) if it cannot."""
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError:
            self.close()
            raise
        self.last_sent = time.monotonic()

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self._answers.put(None)
            hang_up(self.sock)

    def _read_commands(self) -> None:
        try:
            while not self.closed.is_set():
                body = read_frame(self.sock, MAX_COMMAND_BYTES)
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
                outcome = self.on_command(self, cmd)
                if isinstance(outcome, Future):
                    # Answered when done (an awaited reservation may take seconds): the
                    # answers of the commands behind it never wait for it.
                    outcome.add_done_callback(functools.partial(self._done, call_id))
                else:
                    self._answers.put((call_id, outcome))
        except Exception as e:  # unreadable stream, or a bug: never a reader dead behind a live socket
            if isinstance(e, ConnectionError):
                self.router_closed = True
            if not self.closed.is_set():
                log.info("worker channel %s closed while reading commands: %r", self.address, e)
        finally:
            self.close()  # the router must see the loss, and the worker's keeper too

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
                self.send(data)
            except OSError:
                return
