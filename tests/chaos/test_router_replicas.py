"""Two router replicas over one pool (``pdserve serve --routers 2``) on a local Ray cluster:
requests spread over both on HTTP and gRPC, exact against HF transformers; the chaos suite's
``router_kill`` (one replica SIGKILLed mid-stream: the other's streams untouched, the killed
one's requests aborted on the workers within a second, every block freed, the replica back
and serving)."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

chaos = pytest.importorskip("benchmarks.chaos")
chaos_routers = pytest.importorskip("benchmarks.chaos_routers")


@pytest.fixture(scope="module")
def deployment() -> Any:
    from pdserve.deploy.ray_instance import start_ray

    start_ray(None, 16)
    st = chaos_routers.start_replicated(prefill=1, decode=2, routers=2)
    yield st
    st.stop()


def test_requests_spread_over_both_replicas_exactly(work: Any, deployment: Any) -> None:
    from pdserve.v1 import inference_pb2 as pb
    from pdserve.v1 import inference_pb2_grpc as pb_grpc

    ep = deployment.service.endpoints
    served: dict[str, set[str]] = {"http": set(), "grpc": set()}
    for i in range(12):
        prompt, _ = work.before[i % len(work.before)]
        ref = work.refs_before[i % len(work.before)][:12]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        r = httpx.post(f"{ep.http}/v1/completions", json=body, timeout=60)  # a new connection each
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref
        served["http"].add(r.headers["x-pdserve-router"])
        req = pb.GenerateRequest()
        req.token_ids.ids.extend(prompt)
        req.sampling.max_tokens, req.sampling.temperature, req.sampling.ignore_eos = 12, 0.0, True
        with grpc.insecure_channel(ep.grpc) as channel:
            responses = pb_grpc.InferenceStub(channel).Generate(req, timeout=60)
            ids = [t for msg in responses for t in msg.chunk.token_ids]
            served["grpc"].add(dict(responses.initial_metadata())["pdserve-router"])
        assert ids == ref
    assert served == {"http": {"0", "1"}, "grpc": {"0", "1"}}, served


def test_router_kill(work: Any, deployment: Any) -> None:
    r = chaos_routers.router_kill(work, deployment, deployment.service.endpoints.grpc)
    print(r)
    assert (r["failed"], r["tokens_lost"], r["tokens_duplicated"]) == (0, 0, 0), r
    assert r["killed_failed"] >= 1, r  # the killed replica had streams in flight, and they ended
    assert r["killed_tokens_wrong"] == 0, r  # what its clients got before was right
    assert r["abort_s"] <= chaos_routers.ABORT_LIMIT_S, r
    assert (r["blocks_leaked"], r["state_left"]) == (0, 0), r
    assert r["rejoin_s"] is not None and r["rejoin_s"] < 30, r
    assert r["survivor_gap_ms_max_after"] is None or r["survivor_gap_ms_max_after"] < 1000, r


def test_a_replica_sigtermed_mid_stream_drains(work: Any, deployment: Any) -> None:
    r = chaos_routers.replica_term(work, deployment, deployment.service.endpoints.grpc)
    assert (r["failed"], r["tokens_lost"], r["tokens_duplicated"]) == (0, 0, 0), r
    assert r["drained_streams"] >= 1, r
    assert len(r["after_on"]) == 1 and r["after_on"] != [r["victim"]], r  # new ones went to the other
