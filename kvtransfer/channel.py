"""One authenticated, framed connection between two transports (socket I/O, no policy).

Set-up (mutual authentication with a shared secret, no secret on the wire)::

    server -> client   challenge {nonce_s}
    client -> server   hello     {mac = HMAC(secret, "client" + nonce_s), nonce_c, layout, backend, pid}
    server -> client   welcome   {mac = HMAC(secret, "server" + nonce_c), backend, info}
                    or refuse    {reason, cause}

After set-up either side may write frames (``send``, serialized by a lock so a frame and its raw
payload are never interleaved with another) while one reader thread reads them. Every blocking
call has a timeout; a timeout or a short read breaks the connection, because a byte stream that
lost its framing cannot be resynchronised.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import select
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.kvtransfer import wire
from pdserve.kvtransfer.heads import layout_mismatch
from pdserve.kvtransfer.states import FailureCause, TransferError
from pdserve.kvtransfer.tls import InternalTls, TlsStream

_IOV_MAX = 512
HANDSHAKE_MAX_BYTES = 16 << 10
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peering:
    """What both ends of every connection must agree on, and how long to wait for each other."""

    layout: dict[str, Any]
    secret: bytes
    io_timeout_s: float
    connect_timeout_s: float
    tls: InternalTls | None = None  # set: every connection runs over TLS (both ends must agree)
    handshake_timeout_s: float = 2.0  # a connection's whole set-up, TLS included


class ThreadGroup:
    """Background threads of one endpoint, joined on close so that none touches the KV cache
    (or a peer's mapping) after the owner closed the transport."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def spawn(self, target: Callable[..., None], *args: Any, name: str) -> None:
        def run() -> None:
            try:
                target(*args)
            except Exception:  # a background failure is logged, never lost or re-raised into nowhere
                log.exception("kv transfer thread %s failed", name)

        th = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(th)
        th.start()

    def join(self, timeout_s: float = 2.0) -> None:
        with self._lock:
            threads = list(self._threads)
        for th in threads:
            if th is not threading.current_thread():
                th.join(timeout=timeout_s)


class ConnectionBroken(TransferError):
    """The connection itself failed (lost, or an I/O timeout mid-frame): its byte stream is no
    longer usable, so everything in flight on it fails. Other ``TransferError``s concern one
    transfer only."""


class ConnectionLost(ConnectionBroken):
    def __init__(self, message: str) -> None:
        super().__init__(FailureCause.PEER_LOST, message)


# TLS alerts a peer sends when it refuses this side's certificate. Under TLS 1.3 the server checks
# the client's certificate after the client has finished its handshake, so a client learns of the
# refusal only at its first read or write on the session.
_REFUSED_ALERTS = ("CERTIFICATE", "UNKNOWN_CA", "ACCESS_DENIED")


def _lost(peer: str, what: str, e: OSError) -> ConnectionBroken:
    """The error an I/O failure on a connection is raised as: a refused certificate is AUTH (a
    deployment's configuration to fix), anything else a lost peer."""
    reason = getattr(e, "reason", None) or ""
    if isinstance(e, ssl.SSLError) and any(a in reason for a in _REFUSED_ALERTS):
        return ConnectionBroken(FailureCause.AUTH, f"{peer} refused this member's TLS certificate ({reason})")
    return ConnectionLost(f"{what} {peer} failed: {e}")


def _advance(views: list[memoryview], start: int, nbytes: int) -> int:
    """Account for ``nbytes`` moved from ``views[start:]``: skip the buffers now complete, trim a
    partial one in place; returns the index of the first unfinished buffer."""
    while nbytes:
        n = len(views[start])
        if nbytes >= n:
            nbytes -= n
            start += 1
        else:
            views[start] = views[start][nbytes:]
            nbytes = 0
    return start


def mac(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


class Connection:
    def __init__(self, sock: socket.socket, io_timeout_s: float, peer: str) -> None:
        sock.settimeout(io_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock: socket.socket | TlsStream = sock
        self.peer = peer
        self.io_timeout_s = io_timeout_s
        self.send_lock = threading.Lock()
        self.closed = threading.Event()
        self.info: dict[str, Any] = {}
        self.remote_pid = 0
        self.backend = ""
        self.peer_layout: dict[str, Any] = {}  # receiver side: the sender's layout from its hello

    def start_tls(self, tls: InternalTls, server_side: bool) -> None:
        """Run the TLS handshake; every byte after it is encrypted. ``TransferError(AUTH)`` for
        a peer without the deployment's certificate (or one that does not speak TLS)."""
        assert isinstance(self.sock, socket.socket), "TLS started twice"
        context = tls.server_context() if server_side else tls.client_context()
        try:
            self.sock = TlsStream.wrap(self.sock, context, server_side)
        except TimeoutError:
            self.close()
            msg = f"TLS handshake with {self.peer} timed out"
            raise ConnectionBroken(FailureCause.TIMEOUT, msg) from None
        except ssl.SSLError as e:
            self.close()
            raise TransferError(FailureCause.AUTH, f"TLS handshake with {self.peer} failed: {e}") from None
        except OSError as e:
            self.close()
            raise ConnectionLost(f"TLS handshake with {self.peer} failed: {e}") from None

    # -- writing -----------------------------------------------------------------------------
    def send(self, frame_type: str, payload: Sequence[Any] = (), **fields: Any) -> None:
        """Write one frame, then ``payload`` buffers (raw bytes) in the same critical section."""
        data = wire.encode(frame_type, **fields)
        with self.send_lock:
            self._send_locked(data, payload)

    def _send_locked(self, header: bytes, payload: Sequence[Any]) -> None:
        try:
            sock = self.sock
            if isinstance(sock, TlsStream):  # sealed in batches: no scatter write through TLS
                sock.sendall_many([header, *payload])
                return
            sock.sendall(header)
            buffers = [v for v in (memoryview(b).cast("B") for b in payload) if len(v)]
            start = 0
            while start < len(buffers):
                start = _advance(buffers, start, sock.sendmsg(buffers[start : start + _IOV_MAX]))
        except TimeoutError:
            self.close()
            raise ConnectionBroken(FailureCause.TIMEOUT, f"send to {self.peer} timed out") from None
        except OSError as e:
            self.close()
            raise _lost(self.peer, "send to", e) from None
        except ValueError as e:
            self.close()
            raise ConnectionLost(f"send to {self.peer} failed: {e}") from None

    # -- reading -----------------------------------------------------------------------------
    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into([memoryview(buf)])
        return bytes(buf)

    def read_frame(self, idle: bool = False, max_bytes: int = wire.MAX_FRAME_BYTES) -> dict[str, Any]:
        """The next frame; raises ``ConnectionLost``, ``TransferError`` or ``wire.FrameError``.

        ``idle=True`` waits for the frame's first byte without a time limit (a quiet connection is
        healthy); the rest of the frame must then arrive within the I/O timeout.
        """
        if idle:
            # Wait with select: the socket's own timeout must keep bounding the writers'
            # sends on this same socket, so it is never changed.
            while not self.closed.is_set():
                if isinstance(self.sock, TlsStream) and self.sock.pending():
                    break  # decrypted or buffered bytes: select on the socket cannot see them
                try:
                    readable, _, _ = select.select([self.sock], [], [], 0.5)
                except (OSError, ValueError) as e:
                    self.close()
                    raise ConnectionLost(f"{self.peer}: {e}") from None
                if readable:
                    break
            if self.closed.is_set():
                raise ConnectionLost(f"connection to {self.peer} closed")
        try:
            (n,) = wire.LENGTH.unpack(self._recv_exact(wire.LENGTH.size))
            wire.check_length(n, max_bytes)
            return wire.decode_body(self._recv_exact(n))
        except wire.FrameError:
            self.close()
            raise

    def recv_into(self, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` completely, in order (scatter read straight into their memory)."""
        views = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
        views = [v for v in views if len(v)]
        start = 0
        sock = self.sock
        try:
            while start < len(views):
                if isinstance(sock, TlsStream):
                    got = sock.recv_into(views[start])
                else:
                    got = sock.recvmsg_into(views[start : start + _IOV_MAX])[0]
                if got == 0:
                    raise ConnectionLost(f"{self.peer} closed the connection")
                start = _advance(views, start, got)
        except TimeoutError:
            self.close()
            raise ConnectionBroken(FailureCause.TIMEOUT, f"read from {self.peer} timed out") from None
        except OSError as e:
            self.close()
            raise _lost(self.peer, "read from", e) from None

    def drain(self, nbytes: int) -> None:
        """Read and discard ``nbytes`` (the payload of a frame we ignore)."""
        scratch = bytearray(min(nbytes, 1 << 20))
        while nbytes:
            step = min(nbytes, len(scratch))
            self.recv_into([memoryview(scratch)[:step]])
            nbytes -= step

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        with contextlib.suppress(OSError):  # the peer may have closed first
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _expect(conn: Connection, frame: dict[str, Any], *types: str) -> dict[str, Any]:
    if frame["t"] not in types:
        raise TransferError(FailureCause.PROTOCOL, f"expected {'/'.join(types)}, got {frame['t']}")
    return frame


def server_handshake(
    conn: Connection,
    secret: bytes,
    layout: dict[str, Any],
    offers: dict[str, dict[str, Any]],
    tls: InternalTls | None = None,
    deadline_s: float | None = None,
) -> dict[str, Any]:
    """Authenticate a client and check its layout and backend (one of ``offers``, each with the
    info a sender needs for it); returns its hello. Refuses, then raises, otherwise. With
    ``tls`` the TLS handshake comes first, under the same deadline.

    The whole exchange has one deadline (``deadline_s``, by default the connection's I/O
    timeout): the per-read timeout alone would let an unauthenticated peer that trickles a byte
    every few seconds hold a connection for ever. Past it the connection is closed, which ends
    the read.
    """
    timer = threading.Timer(conn.io_timeout_s if deadline_s is None else deadline_s, conn.close)
    timer.daemon = True
    timer.start()
    try:
        if tls is not None:
            conn.start_tls(tls, server_side=True)
        hello = _server_exchange(conn, secret, layout, offers)
    finally:
        timer.cancel()
    if conn.closed.is_set():
        raise ConnectionBroken(FailureCause.TIMEOUT, f"handshake with {conn.peer} took too long")
    return hello


def _server_exchange(
    conn: Connection, secret: bytes, layout: dict[str, Any], offers: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    nonce = os.urandom(16)
    conn.send("challenge", nonce=nonce)
    # Unauthenticated bytes: a small cap before anything is decoded.
    hello = _expect(conn, conn.read_frame(max_bytes=HANDSHAKE_MAX_BYTES), "hello")
    if not hmac.compare_digest(hello["mac"], mac(secret, b"client", nonce)):
        conn.send("refuse", reason="authentication failed", cause=FailureCause.AUTH.value)
        raise TransferError(FailureCause.AUTH, f"client {conn.peer} failed authentication")
    reason = layout_mismatch(layout, hello["layout"])  # head counts may differ: TP ranks
    if reason is not None:
        conn.send("refuse", reason=reason, cause=FailureCause.LAYOUT_MISMATCH.value)
        raise TransferError(FailureCause.LAYOUT_MISMATCH, reason)
    backend = hello["backend"]
    if backend not in offers:
        reason = f"backend {backend!r} not offered (offers: {sorted(offers)})"
        conn.send("refuse", reason=reason, cause=FailureCause.REJECTED.value)
        raise TransferError(FailureCause.REJECTED, reason)
    conn.remote_pid = hello["pid"]
    conn.backend = backend
    conn.peer_layout = hello["layout"]
    conn.send("welcome", mac=mac(secret, b"server", hello["nonce"]), backend=backend, info=offers[backend])
    return hello


def client_handshake(
    conn: Connection,
    secret: bytes,
    layout: dict[str, Any],
    backend: str,
    info: dict[str, Any] | None = None,
    tls: InternalTls | None = None,
) -> dict[str, Any]:
    """Authenticate to a server and prove it knows the secret too; returns its welcome info.
    With ``tls`` the TLS handshake comes first."""
    if tls is not None:
        conn.start_tls(tls, server_side=False)
    challenge = _expect(conn, conn.read_frame(), "challenge")
    nonce = os.urandom(16)
    conn.send(
        "hello",
        mac=mac(secret, b"client", challenge["nonce"]),
        nonce=nonce,
        layout=layout,
        backend=backend,
        pid=os.getpid(),
        info=info or {},
    )
    reply = _expect(conn, conn.read_frame(), "welcome", "refuse")
    if reply["t"] == "refuse":
        try:
            cause = FailureCause(reply["cause"])
        except ValueError:
            cause = FailureCause.PROTOCOL
        raise TransferError(cause, f"{conn.peer} refused the connection: {reply['reason']}")
    if not hmac.compare_digest(reply["mac"], mac(secret, b"server", nonce)):
        raise TransferError(FailureCause.AUTH, f"{conn.peer} failed to prove the shared secret")
    conn.info = reply["info"]
    conn.backend = backend
    return conn.info
