"""``--internal-tls``: the KV channel between workers and every worker's channel to the router
run over TLS with the deployment's own CA. Greedy tokens still equal the HF reference, the
channels speak nothing before a TLS handshake, and a client holding another deployment's
certificate is refused by both."""

from __future__ import annotations

import concurrent.futures
import random
import socket
import ssl

import pytest

from pdserve.kvtransfer.tls import InternalTls, TlsStream
from tests.service.helpers import grpc_request, hf_reference, running_service, stub


def _speaks_first(address: str) -> bytes:
    """What a server sends a client that sends nothing: a plaintext channel's challenge at once;
    a TLS server waits for the client's hello."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.settimeout(1.0)
        try:
            return s.recv(64)
        except TimeoutError:
            return b""


def _handshake(address: str, tls: InternalTls) -> None:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.settimeout(5)
        TlsStream.wrap(s, tls.client_context(), server_side=False).recv(1)


def test_internal_tls_end_to_end() -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(20, 120))] for _ in range(6)]
    with running_service(use_ray=False, internal_tls=True) as (st, ep):
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda p: list(stub(ep).Generate(grpc_request(p, 8)))[-1], prompts))
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.chunk.token_ids) == hf_reference(prompt, 8)
            assert out.result.prefill_worker == "prefill-0"  # the KV crossed the channel
        channel = st.service._channel_address
        [kv] = [h.info.address for h in st.service.handles if h.info.address]
        for address in (channel, kv):
            assert _speaks_first(address) == b"", address
            with pytest.raises((ssl.SSLError, ConnectionError, TimeoutError)):
                _handshake(address, InternalTls.generate())  # another deployment's member
        assert st.service.spec.internal_tls
