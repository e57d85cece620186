"""The HTTP and gRPC APIs over an in-process deployment (real servers, real KV transfers, no Ray)."""

from __future__ import annotations

import json
import random
from typing import Any

import grpc
import httpx
import openai
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.router.config import Caps
from pdserve.v1 import inference_pb2 as pb
from pdserve.worker.control import RequestState
from tests.service.helpers import (
    MODEL,
    all_free,
    assert_no_request_state,
    grpc_request,
    hf_reference,
    running_service,
    start_service,
    status,
    stub,
    wait_for,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def svc():
    with running_service(use_ray=False, caps=Caps(max_tokens=512, max_n=4, max_logprobs=5)) as (_, ep):
        yield ep


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 90))] for _ in range(n)]


def complete(ep: Any, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    return httpx.post(f"{ep.http}/v1/completions", json=body, timeout=60)


def test_models_health_and_status(svc) -> None:
    assert httpx.get(f"{svc.http}/health").status_code == 200
    models = httpx.get(f"{svc.http}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    st = status(svc)
    assert st["ready"] and st["mode"] == "disaggregated"
    assert sorted(w["role"] for w in st["workers"]) == ["decode", "prefill"]
    info = stub(svc).GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id == MODEL and info.vocab_size == 259 and info.max_logprobs == 5
    cs = stub(svc).GetClusterStatus(pb.GetClusterStatusRequest())
    assert cs.ready and {w.role for w in cs.workers} == {pb.WORKER_ROLE_PREFILL, pb.WORKER_ROLE_DECODE}


def test_http_matches_hf_with_token_ids(svc) -> None:
    for i, p in enumerate(prompts(3, seed=1)):
        r = complete(svc, prompt=p, max_tokens=6 + i, temperature=0, ignore_eos=True, return_token_ids=True)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["prompt_token_ids"] == p
        assert choice["token_ids"] == hf_reference(p, 6 + i)
        assert r.json()["usage"]["completion_tokens"] == 6 + i


def test_grpc_matches_hf(svc) -> None:
    for p in prompts(3, seed=2):
        [resp] = list(stub(svc).Generate(grpc_request(p, 9)))
        assert list(resp.chunk.token_ids) == hf_reference(p, 9)
        r = resp.result
        assert r.finish_reason == pb.FINISH_REASON_LENGTH
        assert r.usage.prompt_tokens == len(p) and r.usage.completion_tokens == 9
        assert list(r.prompt_token_ids) == p
        assert r.prefill_worker == "prefill-0" and r.decode_worker == "decode-0"
        assert 0 < r.timing.queue_ms <= r.timing.ttft_ms <= r.timing.e2e_ms


def test_queue_time_ends_before_the_first_token(svc) -> None:
    """queue_ms ends when prefill took the prompt in, never after the first token left."""
    for i, p in enumerate(prompts(6, seed=9)):
        [resp] = list(stub(svc).Generate(grpc_request(p, 2 + i % 3)))
        t = resp.result.timing
        assert 0 < t.queue_ms <= t.ttft_ms <= t.e2e_ms, t


def test_seeds_cross_the_whole_documented_range(svc) -> None:
    """A seed is any 64-bit value: the high half of uint64 reaches the sampler too, and a seed
    and its value modulo 2**64 draw alike (HTTP and gRPC)."""
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 1.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    drawn = {}
    for seed in (2**63, 2**64 - 1, -1):
        r = complete(svc, seed=seed, **body)
        assert r.status_code == 200, r.text
        drawn[seed] = r.json()["choices"][0]["token_ids"]
    assert drawn[2**64 - 1] == drawn[-1]
    [resp] = list(stub(svc).Generate(grpc_request([5, 6, 7], 6, temperature=1.0, seed=2**64 - 1)))
    assert list(resp.chunk.token_ids) == drawn[-1]
    r = complete(svc, seed=2**64 - 1, n=2, **body)  # the second sample's seed wraps round to 0
    assert r.status_code == 200, r.text
    zero = complete(svc, seed=0, **body).json()["choices"][0]["token_ids"]
    assert r.json()["choices"][1]["token_ids"] == zero
    r = complete(svc, seed=2**64, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_grpc_streaming_in_order(svc) -> None:
    p = prompts(1, seed=3)[0]
    msgs = list(stub(svc).Generate(grpc_request(p, 20, stream=True)))
    ids = [t for m in msgs for t in m.chunk.token_ids]
    assert ids == hf_reference(p, 20)
    assert len(msgs) >= 2 and msgs[-1].HasField("result")
    assert all(not m.HasField("result") for m in msgs[:-1])
    assert msgs[-1].result.usage.completion_tokens == 20


def sse_events(resp: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_http_streaming_order_and_usage(svc) -> None:
    p = prompts(1, seed=4)[0]
    body = dict(
        model=MODEL,
        prompt=p,
        max_tokens=15,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
    )
    with httpx.stream("POST", f"{svc.http}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage == {
        "prompt_tokens": len(p),
        "completion_tokens": 15,
        "total_tokens": len(p) + 15,
        "prompt_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
    }
    chunks = [e for e in events[:-2]]
    ids = [t for e in chunks for t in e["choices"][0].get("token_ids", [])]
    assert ids == hf_reference(p, 15)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])


def test_openai_client_completions_and_chat(svc) -> None:
    client = openai.OpenAI(base_url=f"{svc.http}/v1", api_key="unused")
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage is not None
    text = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=5, temperature=0, stream=True
        )
        if ch.choices
    )
    assert text == c.choices[0].text
    msgs: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for ch in streamed:
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
        if ch.usage is not None:
            usage = ch.usage
    assert "".join(parts) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]
    extra = client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=4,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "seed": 7},
    )
    assert extra.usage is not None and extra.usage.completion_tokens >= 2


def test_n_logprobs_and_stop_strings(svc) -> None:
    r = complete(svc, prompt="xyz", max_tokens=4, n=3, seed=1, temperature=1.0, logprobs=2)
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    assert body["usage"]["completion_tokens"] == 12
    base = complete(svc, prompt="stop test", max_tokens=30, temperature=0, ignore_eos=True).json()
    text = base["choices"][0]["text"]
    if len(text) >= 6:
        stop = text[3:6]
        cut = complete(svc, prompt="stop test", max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
        c = cut.json()["choices"][0]
        assert c["text"] == text[: text.index(stop)]
        assert c["finish_reason"] == "stop" and c["stop_reason"] == stop


BAD_HTTP = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 513}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 500, "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 5}, "n"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": [1, 2, 999999]}, "prompt"),
    ({"prompt": [1, 2, -1]}, "prompt"),
    ({"prompt": [5] * 2000, "max_tokens": 100}, "max_tokens"),
    ({"prompt": "x", "model": "gpt-4"}, "model"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
]


@pytest.mark.parametrize(("body", "field"), BAD_HTTP)
def test_bad_http_input_names_the_field(svc, body: dict[str, Any], field: str) -> None:
    r = complete(svc, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field), err


def test_malformed_json_and_bad_chat(svc) -> None:
    r = httpx.post(
        f"{svc.http}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    body = b'{"model": "tiny",\n "prompt": "x", "max_tokens": 3,,}'
    r = httpx.post(f"{svc.http}/v1/completions", content=body, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None, err
    assert err["message"] == (
        "body: not valid JSON: Expecting property name enclosed in double quotes at line 2, column 33 "
        "(character 50)"
    ), err
    r = httpx.post(f"{svc.http}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(
        f"{svc.http}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert complete(svc, prompt="still serving", max_tokens=2).status_code == 200


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 600}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": 9}, "logprobs"),
    ],
)
def test_bad_grpc_input(svc, change: dict[str, Any], field: str) -> None:
    req = grpc_request([5, 6, 7], 4)
    for k, v in change.items():
        setattr(req.sampling, k, v)
    with pytest.raises(grpc.RpcError) as e:
        list(stub(svc).Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field)


def test_bad_grpc_prompt(svc) -> None:
    for req in (pb.GenerateRequest(), grpc_request([1, 2, 400], 3)):
        with pytest.raises(grpc.RpcError) as e:
            list(stub(svc).Generate(req))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("prompt")
    [ok] = list(stub(svc).Generate(grpc_request([1, 2, 3], 3)))
    assert len(ok.chunk.token_ids) == 3


def test_grpc_health_and_reflection(svc) -> None:
    ch = grpc.insecure_channel(svc.grpc)
    h = health_pb2_grpc.HealthStub(ch)
    for name in ("", "pdserve.v1.Inference"):
        serving = health_pb2.HealthCheckResponse.SERVING
        assert h.Check(health_pb2.HealthCheckRequest(service=name)).status == serving
    with pytest.raises(grpc.RpcError) as e:
        h.Check(health_pb2.HealthCheckRequest(service="nope.Service"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    [resp] = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert "pdserve.v1.Inference" in names and "grpc.health.v1.Health" in names
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
    # v1, which current clients (grpcurl) ask first: the same messages on the wire as v1alpha
    v1 = ch.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    ask = reflection_pb2.ServerReflectionRequest
    asks = [ask(list_services=""), ask(file_containing_symbol="pdserve.v1.Inference"),
            ask(file_containing_symbol="grpc.reflection.v1.ServerReflection")]  # fmt: skip
    listed, inference, itself = list(v1(iter(asks), timeout=10))
    assert {s.name for s in listed.list_services_response.service} == names
    fdp = descriptor_pb2.FileDescriptorProto
    files = [fdp.FromString(r.file_descriptor_response.file_descriptor_proto[0]) for r in (inference, itself)]
    assert [f.package for f in files] == ["pdserve.v1", "grpc.reflection.v1"]
    assert files[1].service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"


def test_openapi_schema_lists_the_routes(svc) -> None:
    spec = httpx.get(f"{svc.http}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/cluster/status"):
        assert path in spec["paths"], path
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "top_k", "return_token_ids", "stream_options"} <= set(props)


def test_api_key_on_every_route() -> None:
    st, ep = start_service(use_ray=False, api_key="s3cret-key", colocated=1)
    try:
        good = {"Authorization": "Bearer s3cret-key"}
        assert httpx.get(f"{ep.http}/health").status_code == 200
        for path in ("/v1/models", "/cluster/status", "/metrics", "/openapi.json", "/docs"):
            assert httpx.get(f"{ep.http}{path}").status_code == 401, path
            assert httpx.get(f"{ep.http}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{ep.http}/v1/models", headers=good).status_code == 200
        r = httpx.post(f"{ep.http}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 401
        r = httpx.post(
            f"{ep.http}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, headers=good
        )
        assert r.status_code == 200
        s = stub(ep)
        for call in (
            lambda md: list(s.Generate(grpc_request([1, 2], 2), metadata=md)),
            lambda md: s.GetModelInfo(pb.GetModelInfoRequest(), metadata=md),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call(())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                call((("authorization", "Bearer wrong"),))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call((("authorization", "Bearer s3cret-key"),))
        h = health_pb2_grpc.HealthStub(grpc.insecure_channel(ep.grpc))
        assert h.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Inference")).status == 1
    finally:
        st.stop()


def blocked_by_a_full_decode_worker(s: Any, prompt: list[int]) -> tuple[Any, Any, Any]:
    """On a 40-block decode worker: a long stream holding 32 or more blocks (and with 100 tokens
    to go, so that it does not end and free them while the test looks), and a request for
    ``prompt`` (more than the rest) that prefill served but decode has no room for yet; its
    first message."""
    hog = s.Generate(grpc_request([7] * 300, 300, stream=True))
    got = 0
    while got < 200:
        got += len(next(hog).chunk.token_ids)
    blocked = s.Generate(grpc_request(prompt, 8, stream=True))
    first = next(blocked)
    assert len(first.chunk.token_ids) == 1  # prefilled while decode has no room
    return hog, blocked, first


def test_cancel_while_decode_has_no_room_frees_prefill_blocks() -> None:
    """Prefill finished and the first token went out, but decode is still waiting for room to
    reserve: a cancel now must free the prefill worker's blocks too (nobody else will)."""
    from pdserve.model_runtime.config import CacheConfig

    st, ep = start_service(use_ray=False, cache=CacheConfig(block_size=16, num_blocks=40))
    try:
        hog, blocked, _ = blocked_by_a_full_decode_worker(stub(ep), [9] * 200)
        blocked.cancel()
        hog.cancel()
        wait_for(lambda: all_free(status(ep)), 5.0, "every block freed", lambda: status(ep))
    finally:
        st.stop()


def test_pdserve_bench_against_the_service(svc, tmp_path) -> None:
    """``pdserve bench`` end to end over both protocols, with a saved result."""
    from pdserve.cli import main

    host, port = svc.http.removeprefix("http://").rsplit(":", 1)
    common = ["--random-input-len", "24", "--random-output-len", "6", "--num-prompts", "12", "--disable-tqdm"]
    out = tmp_path / "r.json"
    save = ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    rate = ["--request-rate", "50", "--goodput", "ttft:5000"]
    rc = main(["bench", "--host", host, "--port", port, *rate, *save, *common])
    assert rc == 0
    m = json.loads(out.read_text())
    assert m["completed"] == 12 and m["failed"] == 0 and m["slo_attainment"] == 1.0
    assert m["total_output_tokens"] == 72 and len(m["itls"]) == 12
    gport = svc.grpc.rsplit(":", 1)[1]
    grpc_args = ["--backend", "pdserve-grpc", "--port", gport, "--max-concurrency", "4"]
    assert main(["bench", *grpc_args, *common]) == 0


def test_pdserve_bench_sweep_writes_result_and_plot(svc, tmp_path) -> None:
    from pdserve.cli import main

    host, port = svc.http.removeprefix("http://").rsplit(":", 1)
    args = ["bench", "--host", host, "--port", port, "--random-input-len", "16", "--random-output-len", "4",
            "--num-prompts", "10", "--sweep", "--goodput", "ttft:2000", "--sweep-min-rate", "20",
            "--sweep-max-doublings", "2", "--sweep-steps", "1", "--sweep-seeds", "1",
            "--result-dir", str(tmp_path), "--result-filename", "s.json"]  # fmt: skip
    assert main(args) == 0
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["points"] and all(0 <= p["slo_attainment"] <= 1 for p in res["points"])
    measured = [p["rate"] for p in res["points"]]
    assert res["goodput_rate"] in measured or res["goodput_rate"] == 0.0
    assert (tmp_path / "s.png").stat().st_size > 10_000
    assert main(["bench", "--port", port, "--sweep"]) == 2  # no SLO, no goodput


def test_metrics_endpoint_exposes_the_slo_metrics(svc) -> None:
    assert complete(svc, prompt="metrics", max_tokens=5, temperature=0, ignore_eos=True).status_code == 200
    assert complete(svc, prompt="x", max_tokens=0).status_code == 400  # rejected before admission
    text = httpx.get(f"{svc.http}/metrics").text
    for name in (
        "pdserve:time_to_first_token_seconds_bucket",
        "pdserve:inter_token_latency_seconds_count",
        "pdserve:request_time_per_output_token_seconds_sum",
        "pdserve:e2e_request_latency_seconds_count",
        "pdserve:request_queue_time_seconds_count",
        "pdserve:request_prompt_tokens_count",
        "pdserve:request_generation_tokens_sum",
        'pdserve:request_success_total{finished_reason="length"}',
        'pdserve:num_requests_running{role="decode",worker="decode-0"}',
        'pdserve:kv_cache_usage_perc{role="prefill",worker="prefill-0"}',
    ):
        assert name in text, name
    count = next(ln for ln in text.splitlines() if ln.startswith("pdserve:e2e_request_latency_seconds_count"))
    assert float(count.split()[-1]) >= 1
    # the prefill worker computed the prompt: its busy seconds count up (the planner's reading)
    busy = next(
        ln for ln in text.splitlines() if ln.startswith('pdserve:worker_busy_seconds_total{role="prefill"')
    )
    assert float(busy.split()[-1]) > 0


def test_reused_and_hostile_client_ids_reach_no_other_request(svc) -> None:
    """Workers only ever see ids the router minted: a client id is echoed back and names the
    request for Abort, and re-using one (also one that looks like a router id) is harmless."""
    s = stub(svc)
    p = prompts(1, seed=41)[0]
    ref = hf_reference(p, 6)
    for rid in ("dup", "dup", "req-0123", "", "x" * 200):
        req = grpc_request(p, 6)
        req.request_id = rid
        [msg] = list(s.Generate(req))
        assert list(msg.chunk.token_ids) == ref
        if rid:
            assert msg.result.request_id == rid
        else:
            assert msg.result.request_id.startswith("req-")
    req = grpc_request(p, 6)
    req.request_id = "x" * 257
    with pytest.raises(grpc.RpcError) as e:
        list(s.Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in str(e.value.details())


def test_prefill_lost_after_the_first_token_is_recomputed_on_decode() -> None:
    """The prefill worker dies after sending the first token but before it learnt where the KV
    goes (decode had no room yet). The request must go on: decode recomputes the prompt, and
    the client gets exactly the reference tokens."""
    from pdserve.model_runtime.config import CacheConfig

    st, ep = start_service(use_ray=False, cache=CacheConfig(block_size=16, num_blocks=40))
    try:
        p = [9, 10, 11] * 60
        hog, blocked, first = blocked_by_a_full_decode_worker(stub(ep), p)
        prefill = next(h for h in st.service.handles if h.role.value == "prefill")
        prefill.caller.kill()  # its output channel ends: the router sees it dead
        wait_for(lambda: not prefill.alive, 5.0, "prefill seen dead")
        hog.cancel()  # room on decode: the reservation goes through, the target has nowhere to go
        rest = list(blocked)
        tokens = list(first.chunk.token_ids) + [t for m in rest for t in m.chunk.token_ids]
        assert tokens == hf_reference(p, 8)
        assert rest[-1].result.finish_reason == pb.FINISH_REASON_LENGTH
        assert_no_request_state(st)
    finally:
        st.stop()


def test_a_worker_whose_channel_broke_is_stopped() -> None:
    """The output channel ends while the process lives on (a broken connection): the router
    marks the worker dead and must also stop it, or it computes requests nobody collects."""
    st, ep = start_service(use_ray=False, decode=2)
    try:
        d0 = next(h for h in st.service.handles if h.worker_id == "decode-0")
        host = d0.caller.host  # type: ignore[attr-defined]
        assert host.pusher is not None
        host.pusher.close()  # only the channel: the worker's loop still runs
        wait_for(lambda: not d0.alive, 5.0, "decode-0 seen lost")
        wait_for(lambda: not host.loop._thread.is_alive(), 5.0, "decode-0's loop stopped")
        [msg] = list(stub(ep).Generate(grpc_request([5, 6, 7], 3)))
        assert msg.result.decode_worker == "decode-1"
    finally:
        st.stop()


def test_cancel_reaches_a_reservation_still_waiting_for_room() -> None:
    """The client gives up while decode has no room for its request: the waiting reservation
    must go at once (not hold its place in the queue until room frees, then take blocks)."""
    from pdserve.model_runtime.config import CacheConfig

    st, ep = start_service(use_ray=False, cache=CacheConfig(block_size=16, num_blocks=40))
    try:
        hog, blocked, _ = blocked_by_a_full_decode_worker(stub(ep), [9] * 200)
        decode = next(h for h in st.service.handles if h.role.value == "decode")

        def pending() -> int:
            state = st.run(decode.control(RequestState(), timeout_s=5))
            return state["pending_reservations"]

        # the first token can reach the client before decode has queued the reservation
        wait_for(lambda: pending() == 1, 2.0, "the reservation waiting for room")
        blocked.cancel()
        took = wait_for(lambda: pending() == 0, 1.0, "the waiting reservation dropped")
        assert took < 1.0
        hog.cancel()
        wait_for(lambda: all_free(status(ep)), 5.0, "every block freed", lambda: status(ep))
        assert_no_request_state(st)
    finally:
        st.stop()
