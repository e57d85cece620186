"""TLS for a deployment's internal connections: the KV channel between workers and the worker
channel between each worker and the router (``--internal-tls``).

Trust: every deployment makes its own certificate authority when it starts
(``InternalTls.generate``) and one member certificate signed by it; the router hands both to
its workers in their specs, as it already does the cluster secret. Each end of a connection
presents the member certificate and accepts only a chain to the deployment's CA (mutual TLS),
so a peer needs the deployment's key material to get a connection at all; the HMAC handshake
on top (the cluster secret) is unchanged. Host names are not checked: a member's address is
known only once it runs on its node, and the CA exists for this deployment alone and signs
nothing but its members. The material travels inside Ray's actor specs: on a cluster whose
Ray control plane is not itself encrypted, that hop is as exposed as the secret (docs/deploy.md).

Threads: OpenSSL forbids using one TLS connection from two threads at once, and the KV and
worker channels read on one thread while others write (Python's ``SSLSocket`` used that way
corrupts its state or crashes). ``TlsStream`` therefore keeps the TLS state in an
``ssl.SSLObject`` over memory buffers, touches it only under one lock, and does the blocking
socket I/O outside that lock: one reader and any number of writers that take turns
(``sendall`` calls are serialized) are safe.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import ssl
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

Bytes = bytes | bytearray | memoryview
CHUNK = 256 << 10  # plaintext per TLS write; bounds the ciphertext buffered at once
_KEY_USAGES = (
    "digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
    "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only",
)  # fmt: skip
VALID_DAYS = 3650  # the material dies with the deployment; expiry would only break long runs


class InternalTlsError(ValueError):
    """Internal TLS material that cannot be used (not PEM, a key that does not match)."""


@dataclass(frozen=True)
class InternalTls:
    """A deployment's CA certificate and the member certificate and key every process presents
    (PEM). Pure data: pickles into worker specs; ``server_context``/``client_context`` build
    the SSL contexts (cached per material)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:  # specs get logged: never the key
        return "InternalTls(<deployment CA and member certificate>)"

    @classmethod
    def generate(cls, name: str = "pdserve deployment") -> InternalTls:
        """A fresh CA (never written to disk: its key is dropped once the member certificate is
        signed) and one member certificate for client and server use. P-256 keys."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        now = datetime.datetime.now(datetime.timezone.utc)
        start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
        ca_usage = dict.fromkeys(_KEY_USAGES, False) | {"key_cert_sign": True, "crl_sign": True}
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA {os.urandom(4).hex()}")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(**ca_usage), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        member = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} member")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        return cls(
            ca_pem=ca.public_bytes(pem),
            cert_pem=member.public_bytes(pem),
            key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        )

    def server_context(self) -> ssl.SSLContext:
        return _context(self, server=True)

    def client_context(self) -> ssl.SSLContext:
        return _context(self, server=False)


@functools.lru_cache(maxsize=8)
def _context(tls: InternalTls, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if server:
        # No session tickets: nothing is resumed, and a ticket is a write the reading side
        # would have to send (TlsStream flushes it, but there is no reason to make one).
        ctx.num_tickets = 0
    else:
        ctx.check_hostname = False  # the deployment's own CA is the check (module docstring)
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cadata=tls.ca_pem.decode("ascii"))
        # ``load_cert_chain`` reads only files: a private directory, gone right after.
        with tempfile.TemporaryDirectory(prefix="pdserve-tls-") as d:
            cert, key = Path(d, "cert.pem"), Path(d, "key.pem")
            cert.write_bytes(tls.cert_pem)
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(tls.key_pem)
            ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as e:
        raise InternalTlsError(f"internal TLS material is unusable: {e}") from None
    return ctx


class TlsStream:
    """A TLS connection over a connected blocking socket (see the module docstring for why it
    is not an ``SSLSocket``). The socket's timeout bounds each wait, as on a plain socket;
    errors are ``OSError``s (``ssl.SSLError`` included), end of stream is a 0-byte read."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool) -> None:
        self._sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self._state = threading.Lock()  # the SSLObject and both buffers
        self._wire = threading.Lock()  # ciphertext leaves in the order it was made
        self._rbuf = bytearray(CHUNK)  # ciphertext read from the socket (one reader at a time)

    @classmethod
    def wrap(cls, sock: socket.socket, context: ssl.SSLContext, server_side: bool) -> TlsStream:
        """Run the handshake on ``sock`` (within its timeout per wait); closes nothing on
        failure, so the caller closes ``sock`` as it would a plain one."""
        stream = cls(sock, context, server_side)
        while True:
            refused: ssl.SSLError | None = None
            with stream._state:
                try:
                    stream._obj.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                except ssl.SSLError as e:
                    refused, done = e, False
            if refused is not None:
                # The alert saying why is in the outgoing buffer: sent, the peer reads a refusal
                # (a certificate to fix) instead of a connection closed without a word.
                with contextlib.suppress(OSError):
                    stream._flush()
                raise refused
            stream._flush()
            if done:
                return stream
            if not stream._fill():
                raise ConnectionResetError("the peer closed the connection during the TLS handshake")

    def _fill(self) -> bool:
        """Move ciphertext from the socket into the TLS buffer; False at end of stream."""
        n = self._sock.recv_into(self._rbuf)
        with self._state:
            if n:
                self._incoming.write(memoryview(self._rbuf)[:n])
            else:
                self._incoming.write_eof()
        return n > 0

    def _flush_locked(self) -> None:
        """Send every record the TLS state has made so far, in order. Caller holds ``_wire``:
        whoever drains the buffer sends what it drained before anyone else can send newer
        records."""
        with self._state:
            out = self._outgoing.read()
        if out:
            self._sock.sendall(out)

    def _flush(self) -> None:
        with self._wire:
            self._flush_locked()

    def _seal_and_send(self, views: list[memoryview]) -> None:
        """Caller holds ``_wire``."""
        with self._state:
            for v in views:
                self._obj.write(v)
        self._flush_locked()

    # -- the socket interface the channels use ---------------------------------------------
    def sendall(self, data: Bytes) -> None:
        self.sendall_many([data])

    def sendall_many(self, buffers: Sequence[Bytes]) -> None:
        """Send ``buffers`` in order as one stream: small ones (a KV block per layer) are sealed
        together, up to ``CHUNK`` bytes per socket write, instead of one write each."""
        with self._wire:
            batch: list[memoryview] = []
            size = 0
            for b in buffers:
                whole = memoryview(b).cast("B")
                for i in range(0, len(whole), CHUNK):
                    v = whole[i : i + CHUNK]
                    batch.append(v)
                    size += len(v)
                    if size >= CHUNK:
                        self._seal_and_send(batch)
                        batch, size = [], 0
            if batch:
                self._seal_and_send(batch)

    def recv_into(self, buffer: bytearray | memoryview, nbytes: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        n = nbytes or len(view)
        if n == 0:
            return 0
        while True:
            with self._state:
                got: int | None
                try:
                    got = int(self._obj.read(n, view))  # with a buffer: the count (typeshed says bytes)
                except ssl.SSLWantReadError:
                    got = None
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    got = 0  # closed by the peer, with or without a TLS close
                answer = self._outgoing.pending > 0  # a post-handshake message's answer (rare)
            if answer:  # in order with the writers' records (``_flush_locked``)
                self._flush()
            if got is not None:
                return got
            self._fill()

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self.recv_into(buf)
        return bytes(buf[:got])

    def pending(self) -> bool:
        """Bytes already read from the socket that a ``select`` on it cannot see."""
        with self._state:
            return self._obj.pending() > 0 or self._incoming.pending > 0

    def fileno(self) -> int:
        return self._sock.fileno()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self._sock.setsockopt(level, option, value)

    def getpeername(self) -> tuple[str, int]:
        return self._sock.getpeername()  # type: ignore[no-any-return]

    def shutdown(self, how: int) -> None:
        # No TLS close message: every channel has its own end-of-conversation rules, and a
        # peer reading past the end sees end-of-stream either way.
        self._sock.shutdown(how)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
