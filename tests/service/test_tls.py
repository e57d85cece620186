"""TLS and mutual TLS on both front ends, with the official clients and certificates made at
test time: the ``openai`` client with a custom CA bundle, a gRPC secure channel; clients without
the CA, without a client certificate (under mTLS) or speaking plaintext are refused."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from pdserve.deploy.service import Endpoints
from pdserve.router.tls import TlsConfig, TlsError, load_tls, tls_from_flags
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from tests.service.helpers import grpc_request, running_service

trustme = pytest.importorskip("trustme")
openai = pytest.importorskip("openai")


class Pki:
    """A test CA, the server's certificate for 127.0.0.1, and a client certificate (and a second,
    unrelated CA whose client certificate the server must refuse)."""

    def __init__(self, root: Path) -> None:
        self.ca = trustme.CA()
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        client = self.ca.issue_cert("client@example.test")
        stranger = trustme.CA().issue_cert("stranger@example.test")
        self.ca_file = root / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.cert_file, self.key_file = root / "server.pem", root / "server.key"
        server.cert_chain_pems[0].write_to_path(str(self.cert_file))
        for pem in server.cert_chain_pems[1:]:
            pem.write_to_path(str(self.cert_file), append=True)
        server.private_key_pem.write_to_path(str(self.key_file))
        self.client_pem = root / "client.pem"
        client.private_key_and_cert_chain_pem.write_to_path(str(self.client_pem))
        self.client_cert = client.cert_chain_pems[0].bytes()
        self.client_key = client.private_key_pem.bytes()
        self.stranger_pem = root / "stranger.pem"
        stranger.private_key_and_cert_chain_pem.write_to_path(str(self.stranger_pem))
        self.stranger_cert = stranger.cert_chain_pems[0].bytes()
        self.stranger_key = stranger.private_key_pem.bytes()

    def config(self, mutual: bool) -> TlsConfig:
        return TlsConfig(str(self.cert_file), str(self.key_file), str(self.ca_file) if mutual else "")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module", params=[False, True], ids=["tls", "mtls"])
def served(request: pytest.FixtureRequest, pki: Pki) -> Iterator[tuple[bool, Endpoints]]:
    mutual: bool = request.param
    client = https_client(pki, pki.client_pem if mutual else None)
    with client, running_service(http_client=client, use_ray=False, tls=pki.config(mutual)) as (_, ep):
        yield mutual, ep


def https_client(pki: Pki, cert: Path | None) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(pki.ca_file))
    if cert is not None:
        context.load_cert_chain(str(cert))
    return httpx.Client(verify=context, timeout=30)


def grpc_channel(ep: Endpoints, pki: Pki, key: bytes | None = None, cert: bytes | None = None) -> Any:
    creds = grpc.ssl_channel_credentials(pki.ca.cert_pem.bytes(), key, cert)
    return grpc.secure_channel(ep.grpc, creds)


def test_endpoints_say_https(served: tuple[bool, Endpoints]) -> None:
    assert served[1].http.startswith("https://127.0.0.1:")


def test_openai_client_with_the_ca_bundle(served: tuple[bool, Endpoints], pki: Pki) -> None:
    mutual, ep = served
    client = openai.OpenAI(
        base_url=f"{ep.http}/v1",
        api_key="unused",
        http_client=https_client(pki, pki.client_pem if mutual else None),
    )
    out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_grpc_secure_channel(served: tuple[bool, Endpoints], pki: Pki) -> None:
    mutual, ep = served
    key, cert = (pki.client_key, pki.client_cert) if mutual else (None, None)
    with grpc_channel(ep, pki, key, cert) as channel:
        [msg] = list(pb_grpc.InferenceStub(channel).Generate(grpc_request([5, 6, 7], 4), timeout=30))
    assert len(msg.chunk.token_ids) == 4 and msg.result.usage.completion_tokens == 4


def test_plaintext_and_unknown_server_ca_are_refused(served: tuple[bool, Endpoints], pki: Pki) -> None:
    _, ep = served
    with pytest.raises(httpx.HTTPError):
        httpx.get(ep.http.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{ep.http}/health", timeout=5)  # the system CAs do not know the test CA
    with grpc.insecure_channel(ep.grpc) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.InferenceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_clients_without_a_certificate_from_the_ca(
    served: tuple[bool, Endpoints], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused client gets the TLS alert that says why (it can report more than "Socket
    closed"), and the server logs which client it refused and why."""
    mutual, ep = served
    if not mutual:
        with https_client(pki, None) as client:
            assert client.get(f"{ep.http}/health").status_code == 200
        return
    caplog.set_level(logging.WARNING, logger="pdserve.router.tls_front")
    for cert, alert in ((None, "CERTIFICATE_REQUIRED"), (pki.stranger_pem, "UNKNOWN_CA")):
        with https_client(pki, cert) as client, pytest.raises(httpx.HTTPError, match=alert):
            client.get(f"{ep.http}/health")
    for key, crt in ((None, None), (pki.stranger_key, pki.stranger_cert)):
        with grpc_channel(ep, pki, key, crt) as channel, pytest.raises(grpc.RpcError) as e:
            pb_grpc.InferenceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Socket closed" not in e.value.details(), e.value.details()  # the alert arrived
    said = [r.getMessage() for r in caplog.records]
    refusals = [m for m in said if "refused the TLS client at 127.0.0.1:" in m]
    for front in ("HTTP", "gRPC"):
        mine = " | ".join(m for m in refusals if m.startswith(f"{front}: "))
        assert "it sent no client certificate" in mine, refusals
        assert "its certificate was not accepted: unable to get local issuer" in mine, refusals
    with https_client(pki, pki.client_pem) as client:
        assert client.get(f"{ep.http}/health").status_code == 200


def test_bad_tls_files_are_named(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(TlsError, match=r"--tls-cert .*nope\.pem"):
        load_tls(TlsConfig(str(tmp_path / "nope.pem"), str(pki.key_file)))
    other_key = tmp_path / "other.key"
    pki.ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other_key))
    with pytest.raises(TlsError, match="key does not match"):
        load_tls(TlsConfig(str(pki.cert_file), str(other_key)))
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    with pytest.raises(TlsError, match=r"--tls-client-ca .*: not a PEM file"):
        load_tls(TlsConfig(str(pki.cert_file), str(pki.key_file), str(not_pem)))
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.key_file.read_bytes(), password=None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"pass")))  # fmt: skip
    with pytest.raises(TlsError, match="an encrypted key"):
        load_tls(TlsConfig(str(pki.cert_file), str(locked)))
    with pytest.raises(TlsError, match="go together"):
        tls_from_flags(str(pki.cert_file), None, None)
    with pytest.raises(TlsError, match="needs --tls-cert"):
        tls_from_flags(None, None, str(pki.ca_file))
    assert tls_from_flags(None, None, None) is None


def test_serve_flags(pki: Pki) -> None:
    from pdserve.cli import build_parser
    from pdserve.serve import build

    def config(*flags: str) -> Any:
        return build(build_parser().parse_args(["serve", "--model", "tiny", "--device", "cpu", *flags]))[1]

    assert config().tls is None
    tls = config(
        "--tls-cert", str(pki.cert_file), "--tls-key", str(pki.key_file), "--tls-client-ca", str(pki.ca_file)
    )
    assert tls.tls == pki.config(mutual=True)
    with pytest.raises(TlsError, match="--tls-key"):
        config("--tls-cert", str(pki.cert_file), "--tls-key", str(pki.cert_file) + ".missing")
