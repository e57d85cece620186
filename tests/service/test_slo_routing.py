"""Goodput routing in a running service: conditional disaggregation, SLO admission (429 /
RESOURCE_EXHAUSTED with a retry hint) and the SLO metrics (real servers and transfers, no Ray)."""

from __future__ import annotations

import math
import random

import grpc
import httpx
import pytest

from pdserve.router.slo import Admission, SloClass
from tests.service.helpers import (
    MODEL,
    grpc_request,
    hf_reference,
    running_service,
    start_service,
    stub,
    wait_for,
)

pytest.importorskip("transformers")

CLASSES = (
    SloClass("chat", ttft_ms=60_000, tpot_ms=60_000),  # the default: always met on this CPU
    SloClass("impossible", ttft_ms=0.001, tpot_ms=0.001, admission=Admission.REJECT),
)


@pytest.fixture(scope="module")
def svc():
    with running_service(use_ray=False, local_prefill=True, slo_classes=CLASSES) as (_, ep):
        yield ep


def metric(ep, name: str) -> float:
    text = httpx.get(f"{ep.http}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_short_prompts_prefill_locally_long_ones_remotely_and_both_match_hf(svc) -> None:
    rng = random.Random(5)
    s = stub(svc)
    short = [rng.randrange(3, 256) for _ in range(8)]
    long = [rng.randrange(3, 256) for _ in range(400)]
    seen = {}
    for name, p in (("short", short), ("long", long)):
        resp = list(s.Generate(grpc_request(p, 6)))[-1]
        assert list(resp.chunk.token_ids) == hf_reference(p, 6), name
        seen[name] = resp.result.prefill_worker
    assert seen["short"] == "", "a short prompt is prefilled on the decode worker"
    assert seen["long"] == "prefill-0", "a long prompt goes to the prefill worker"
    text = httpx.get(f"{svc.http}/metrics").text
    assert 'outcome="local_prefill",policy="goodput",reason="short_prompt"' in text
    assert 'outcome="remote_prefill",policy="goodput"' in text

    # Workers on one host share their caches through /dev/shm files: auto picks shm. (Each side's
    # counters reach the router with its next load report: up to a heartbeat apart.)
    def moved() -> tuple[float, float]:
        return (
            metric(svc, 'pdserve:kv_transfer_bytes_total{backend="shm",role="prefill",worker="prefill-0"}'),
            metric(svc, 'pdserve:kv_transfer_bytes_total{backend="shm",role="decode",worker="decode-0"}'),
        )

    wait_for(lambda: moved()[0] == moved()[1] > 0, 5, "both ends' shm byte counts", moved)
    # the tcp series exist from the start (a rate needs the 0 before the first transfer): still 0
    lines = httpx.get(f"{svc.http}/metrics").text.splitlines()
    for role, worker in (("prefill", "prefill-0"), ("decode", "decode-0")):
        series = f'pdserve:kv_transfer_bytes_total{{backend="tcp",role="{role}",worker="{worker}"}}'
        assert f"{series} 0.0" in lines, series


def test_rejected_by_slo_class_with_a_retry_hint(svc) -> None:
    before = metric(svc, 'pdserve:slo_requests_total{slo_class="impossible"}')
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "slo_class": "impossible"}
    r = httpx.post(f"{svc.http}/v1/completions", timeout=30, json=body)
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    assert "impossible" in r.json()["error"]["message"]
    req = grpc_request([5, 6, 7], 4)
    req.slo.slo_class = "impossible"
    with pytest.raises(grpc.RpcError) as e:
        list(stub(svc).Generate(req))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(e.value.trailing_metadata())["retry-after-ms"]) >= 100
    assert metric(svc, 'pdserve:slo_requests_total{slo_class="impossible"}') == before + 2
    assert metric(svc, 'pdserve:router_decisions_total{outcome="rejected"') >= 2
    r = httpx.post(f"{svc.http}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [5], "max_tokens": 2, "slo_class": "nope"})  # fmt: skip
    assert r.status_code == 400 and "slo_class" in r.json()["error"]["message"]
    # the default class still serves
    body = {"model": MODEL, "prompt": [5], "max_tokens": 2}
    r = httpx.post(f"{svc.http}/v1/completions", timeout=30, json=body)
    assert r.status_code == 200


def test_non_finite_request_targets_are_invalid_on_both_front_ends(svc) -> None:
    for field in ("ttft_ms", "tpot_ms"):
        for value in (math.nan, math.inf):
            req = grpc_request([5, 6, 7], 4)
            setattr(req.slo, field, value)
            with pytest.raises(grpc.RpcError) as e:
                list(stub(svc).Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, value)
            assert "finite" in (e.value.details() or "")
    # JSON has no NaN; Python's encoder writes it anyway, and the model's ``ge=0`` refuses it,
    # while a huge number parsed as inf is refused by the class's own rule
    for raw in ('{"model": "%s", "prompt": [5], "max_tokens": 2, "slo_ttft_ms": NaN}',
                '{"model": "%s", "prompt": [5], "max_tokens": 2, "slo_tpot_ms": 1e999}'):  # fmt: skip
        r = httpx.post(f"{svc.http}/v1/completions", timeout=30, content=raw % MODEL,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400, (raw, r.status_code, r.text)


def test_slo_metrics_count_good_requests(svc) -> None:
    before = metric(svc, 'pdserve:slo_met_total{slo_class="chat"}')
    for i in range(3):
        list(stub(svc).Generate(grpc_request([9, 10 + i], 3)))
    assert metric(svc, 'pdserve:slo_met_total{slo_class="chat"}') == before + 3
    text = httpx.get(f"{svc.http}/metrics").text
    assert 'pdserve:goodput_requests_per_second{slo_class="chat"}' in text
    assert 'pdserve:slo_attainment{slo_class="chat"} 1.0' in text
    assert "pdserve:prediction_error_ratio_bucket" in text
    assert 'le="60.0"' in text  # the class's TTFT threshold is a bucket bound
    assert 'pdserve:latency_correction{phase="prefill"' in text
    assert "pdserve:kv_transfers_total" in text and "pdserve:kv_handoff_seconds_count" in text


def test_best_effort_is_admitted_and_served() -> None:
    from pdserve.router.slo import Admission

    classes = (SloClass("be", ttft_ms=0.001, tpot_ms=0.001, admission=Admission.BEST_EFFORT),)
    st, ep = start_service(use_ray=False, slo_classes=classes)
    try:
        resp = list(stub(ep).Generate(grpc_request([3, 4, 5], 4)))[-1]
        assert resp.chunk.token_ids == hf_reference([3, 4, 5], 4)
        text = httpx.get(f"{ep.http}/metrics").text
        assert 'outcome="best_effort"' in text
        assert 'pdserve:slo_requests_total{slo_class="be"} 1.0' in text
        assert 'pdserve:slo_met_total{slo_class="be"} 0.0' in text
    finally:
        st.stop()
