"""The router's worker-channel listener says why it refused a connection, and whose it was."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdserve.router import outputs
from pdserve.router.outputs import OutputListener
from pdserve.worker.codec import CHALLENGE_BYTES, frame


async def _connect_and(listener: OutputListener, send: bytes | None) -> str:
    """Connect to ``listener``, send ``send`` (or nothing) after its challenge, and wait for the
    close; the local address, as the listener names it."""
    host, port = (await listener.start()).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    me = "{}:{}".format(*writer.get_extra_info("sockname")[:2])
    await reader.readexactly(CHALLENGE_BYTES)
    if send is not None:
        writer.write(send)
    await asyncio.wait_for(reader.read(), 5)  # the listener hangs up
    writer.close()
    await listener.close()
    return me


def test_a_silent_peer_is_refused_with_the_reason(caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(outputs, "HANDSHAKE_TIMEOUT_S", 0.2)
    with caplog.at_level(logging.WARNING, logger=outputs.__name__):
        me = asyncio.run(_connect_and(OutputListener(b"s" * 16), None))
    assert f"output channel refused: no hello from {me} within 0.2 s" in caplog.text


def test_a_bad_hello_is_refused_naming_the_peer(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=outputs.__name__):
        me = asyncio.run(_connect_and(OutputListener(b"s" * 16), frame({"hello": 1})))
    assert f"output channel from {me} refused: bad hello frame" in caplog.text
