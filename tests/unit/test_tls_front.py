"""``TlsFront`` relays an accepted client's bytes both ways intact (large and split writes, the
first request arriving with the handshake's last flight), and refuses a client without an
accepted certificate with the alert that says why."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import tempfile
from pathlib import Path

import pytest

from pdserve.router.tls import TlsConfig, mutual_context
from pdserve.router.tls_front import TlsFront

trustme = pytest.importorskip("trustme")


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(tmp: Path, client_cert: bool, payload: bytes) -> bytes:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    server.private_key_and_cert_chain_pem.write_to_path(str(tmp / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
    ca.issue_cert("client@example.test").private_key_and_cert_chain_pem.write_to_path(str(tmp / "client.pem"))
    config = TlsConfig(str(tmp / "server.pem"), str(tmp / "server.pem"), str(tmp / "ca.pem"))
    backend = os.path.join(tempfile.mkdtemp(), "echo")
    echo = await asyncio.start_unix_server(_echo, backend)
    listener = socket.create_server(("127.0.0.1", 0))
    front = TlsFront("test", mutual_context(config, "h2"), listener, backend)
    await front.start()
    context = ssl.create_default_context(cafile=str(tmp / "ca.pem"))
    context.set_alpn_protocols(["h2"])
    if client_cert:
        context.load_cert_chain(str(tmp / "client.pem"))
    try:
        reader, writer = await asyncio.open_connection(*listener.getsockname()[:2], ssl=context)
        for i in range(0, len(payload), 100_000):  # split writes, the first right after the handshake
            writer.write(payload[i : i + 100_000])
        await writer.drain()
        got = await reader.readexactly(len(payload))
        writer.close()
        return got
    finally:
        await front.stop()
        echo.close()


def test_bytes_cross_intact_both_ways(tmp_path: Path) -> None:
    payload = os.urandom(3 << 20)
    assert asyncio.run(_round_trip(tmp_path, True, payload)) == payload


def test_a_client_without_a_certificate_gets_the_alert(tmp_path: Path) -> None:
    with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"):
        asyncio.run(_round_trip(tmp_path, False, b"hello"))
