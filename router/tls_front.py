"""Mutual TLS on the router's front ends, with refusals a client can report and an operator can
read.

gRPC's C core and asyncio (under uvicorn) both end a failed handshake by closing the socket: the
TLS alert OpenSSL wrote is never sent, so a client whose certificate is missing or not trusted
sees only "Socket closed" or an unexpected EOF, and the server says nothing (asyncio logs it at
debug level, gRPC without the peer). Under mutual TLS each front end's port is therefore served
by a ``TlsFront``: it runs the handshake itself over memory BIOs, so a refusal sends the alert
(certificate_required, unknown_ca, ...) and logs which peer was refused and why; an accepted
connection's plaintext is relayed to the server behind it, which listens on a unix socket in a
directory only this user can enter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
LINGER_S = 1.0  # after an alert: read what the client still sends, so the close is no reset
CHUNK = 256 << 10


class TlsFront:
    """Serve ``listener`` (a bound, listening TCP socket) with TLS under ``context``, relaying each
    accepted connection to the unix socket ``backend``; ``what`` names the front end in logs."""

    def __init__(self, what: str, context: ssl.SSLContext, listener: socket.socket, backend: str) -> None:
        self.what = what
        self.context = context
        self.listener = listener
        self.backend = backend
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accepted, sock=self.listener, limit=CHUNK)

    async def stop(self) -> None:
        """Stop accepting and end the connections still open (the servers behind drained them)."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._open):
                writer.close()
            await self._server.wait_closed()
        self.listener.close()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            await self._serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError) as e:  # a peer gone (SSLError is an OSError)
            log.debug("%s: TLS connection ended: %s", self.what, e)
        finally:
            self._open.discard(writer)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = peer_address(writer)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self.context.wrap_bio(incoming, outgoing, server_side=True)
        try:
            await asyncio.wait_for(_handshake(tls, incoming, outgoing, reader, writer), HANDSHAKE_TIMEOUT_S)
        except ssl.SSLError as e:
            log.warning("%s: refused the TLS client at %s: %s", self.what, peer, refusal_reason(e))
            writer.write(outgoing.read())  # the alert: what asyncio and gRPC leave unsent
            await _linger(reader, writer)
            return
        except asyncio.TimeoutError:
            log.warning("%s: the TLS client at %s did not finish its handshake within %g s", self.what,
                        peer, HANDSHAKE_TIMEOUT_S)  # fmt: skip
            return
        backend_reader, backend_writer = await asyncio.open_unix_connection(self.backend, limit=CHUNK)
        try:
            await _relay(tls, incoming, outgoing, (reader, writer), (backend_reader, backend_writer))
        finally:
            backend_writer.close()


def refusal_reason(e: ssl.SSLError) -> str:
    """Why a handshake failed, in words (OpenSSL's reason in brackets)."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"its certificate was not accepted: {e.verify_message} [{e.reason}]"
    words = {
        "PEER_DID_NOT_RETURN_A_CERTIFICATE": "it sent no client certificate (mutual TLS requires one)",
        "HTTP_REQUEST": "it spoke plain HTTP to a TLS port",
        "WRONG_VERSION_NUMBER": "it did not speak TLS",
        "NO_SHARED_CIPHER": "no cipher in common",
        "UNSUPPORTED_PROTOCOL": "no TLS version in common",
        "NO_APPLICATION_PROTOCOL": "no application protocol (ALPN) in common",
    }
    return f"{words.get(e.reason or '', 'handshake failed')} [{e.reason or e}]"


async def _handshake(
    tls: ssl.SSLObject,
    incoming: ssl.MemoryBIO,
    outgoing: ssl.MemoryBIO,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    while True:
        try:
            tls.do_handshake()  # an SSLError leaves the alert in ``outgoing``
        except ssl.SSLWantReadError:
            pass
        else:
            writer.write(outgoing.read())  # the last flight (and TLS 1.3 session tickets)
            return
        if outgoing.pending:
            writer.write(outgoing.read())
            await writer.drain()
        data = await reader.read(CHUNK)
        if not data:
            raise ConnectionError("the client hung up during the TLS handshake")
        incoming.write(data)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send the alert and half-close, then read what the client had already sent (TLS 1.3 lets
    it send data before the server has checked its certificate): closing with unread input
    would reset the connection, and the client might lose the alert with it."""
    with contextlib.suppress(ConnectionError, asyncio.TimeoutError, OSError):
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(LINGER_S):
            while await reader.read(CHUNK):
                pass


Ends = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _relay(
    tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, client: Ends, backend: Ends
) -> None:
    """Decrypt what the client sends to the backend and encrypt what the backend answers, until
    the backend is done (or either side fails)."""

    async def up() -> None:
        # The handshake's last read may have brought the first request with it: decrypt what
        # is buffered before waiting for more.
        while True:
            while True:
                try:
                    plain = tls.read(CHUNK)
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLZeroReturnError:  # the client's close_notify
                    backend[1].write_eof()
                    return
                backend[1].write(plain)
            if outgoing.pending:  # (a key update's answer)
                client[1].write(outgoing.read())
            await backend[1].drain()
            data = await client[0].read(CHUNK)
            if not data:
                break
            incoming.write(data)
        with contextlib.suppress(OSError):
            backend[1].write_eof()

    async def down() -> None:
        while data := await backend[0].read(CHUNK):
            tls.write(data)
            client[1].write(outgoing.read())
            await client[1].drain()
        with contextlib.suppress(ssl.SSLError):
            tls.unwrap()  # close_notify
        client[1].write(outgoing.read())
        await client[1].drain()

    ups, downs = asyncio.ensure_future(up()), asyncio.ensure_future(down())
    try:
        await asyncio.wait({ups, downs}, return_when=asyncio.FIRST_COMPLETED)
        if not downs.done() and ups.exception() is None:
            await asyncio.wait({downs})  # the client is done sending: the backend ends its answer
    finally:
        for task in (ups, downs):
            task.cancel()
        results = await asyncio.gather(ups, downs, return_exceptions=True)
    for r in results:
        if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError):
            raise r


def peer_address(writer: asyncio.StreamWriter) -> str:
    """The connecting side's address, as ``host:port``."""
    name = writer.get_extra_info("peername")
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) and len(name) >= 2 else "an unknown peer"
