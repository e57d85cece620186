"""TLS on the router's front ends (gRPC and HTTP): a certificate chain and key, and optionally
the CA whose certificates clients must present (mutual TLS).

``TlsConfig.load`` reads and checks the files once, at start-up, so a wrong path, an unreadable
file, a key that does not match the certificate or a CA file holding no certificate fails
``pdserve serve`` with one line naming the flag, before any worker starts. Both servers then
get the same bytes: gRPC takes PEM bytes (``grpc.ssl_server_credentials``), uvicorn takes the
paths; under mutual TLS both are served through ``pdserve.router.tls_front`` instead, with
``mutual_context``. Pure standard library.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


class TlsError(ValueError):
    """A TLS file is missing, unreadable or inconsistent; the message names the flag."""


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str  # PEM: the server certificate, then any intermediates
    key_file: str  # PEM: its private key (unencrypted)
    client_ca_file: str = ""  # PEM: set for mutual TLS (clients without a certificate it signed are refused)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)


@dataclass(frozen=True)
class TlsMaterial:
    """The checked files' contents, as gRPC wants them."""

    config: TlsConfig
    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsError(f"{flag} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{flag} {path}: not a PEM file")
    return data


def load_tls(config: TlsConfig) -> TlsMaterial:
    """Read and check ``config``'s files; ``TlsError`` naming the flag on any problem."""
    cert = _read(config.cert_file, "--tls-cert")
    key = _read(config.key_file, "--tls-key")
    ca = _read(config.client_ca_file, "--tls-client-ca") if config.mutual else None
    if b"ENCRYPTED" in key.split(b"\n", 1)[0] or b"Proc-Type: 4,ENCRYPTED" in key:
        raise TlsError(f"--tls-key {config.key_file}: an encrypted key; give the server an unencrypted one")

    def no_password() -> str:  # OpenSSL would prompt on the terminal for a passphrase
        raise TlsError(f"--tls-key {config.key_file}: an encrypted key; give the server an unencrypted one")

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.cert_file, config.key_file, password=no_password)
    except ssl.SSLError as e:
        msg = f"--tls-cert/--tls-key: the key does not match the certificate or is invalid ({e})"
        raise TlsError(msg) from None
    if config.client_ca_file:
        try:
            context.load_verify_locations(cafile=config.client_ca_file)
        except ssl.SSLError as e:
            msg = f"--tls-client-ca {config.client_ca_file}: no usable CA certificate ({e})"
            raise TlsError(msg) from None
    return TlsMaterial(config, cert, key, ca)


def mutual_context(config: TlsConfig, alpn: str) -> ssl.SSLContext:
    """The server side of mutual TLS for a front end that speaks ``alpn`` ("h2" for gRPC,
    "http/1.1" for HTTP): a client must present a certificate that the client CA signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.cert_file, config.key_file)
    context.load_verify_locations(cafile=config.client_ca_file)
    context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols([alpn])
    return context


def tls_from_flags(cert: str | None, key: str | None, client_ca: str | None) -> TlsConfig | None:
    """The flags as a ``TlsConfig``; ``TlsError`` for a combination that cannot work."""
    if not cert and not key:
        if client_ca:
            raise TlsError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if not cert or not key:
        raise TlsError("--tls-cert and --tls-key go together")
    return TlsConfig(cert, key, client_ca or "")
