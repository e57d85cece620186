"""The disaggregated service on a real local Ray cluster: workers are Ray actors in their own
processes, KV moves between them over the transport, clients speak real gRPC and HTTP."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest

from pdserve.v1 import inference_pb2 as pb
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
pytestmark = pytest.mark.slow

LONG = 1500  # tokens: a request that is still running when the test interrupts it


@pytest.fixture(scope="module")
def cluster():
    with running_service(use_ray=True, prefill=1, decode=1) as (st, ep):
        yield st, ep


def mixed_prompts(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 256) for _ in range(rng.choice([1, 5, 17, 40, 90, 200]))], rng.randrange(1, 40))
        for _ in range(n)
    ]


def test_16_concurrent_grpc_requests_match_hf(cluster) -> None:
    _, ep = cluster
    work = mixed_prompts(16, seed=11)
    s = stub(ep)

    def one(pm: tuple[list[int], int]) -> Any:
        return list(s.Generate(grpc_request(pm[0], pm[1], stream=True)))

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, work))
    for (prompt, n), msgs in zip(work, results, strict=True):
        ids = [t for m in msgs for t in m.chunk.token_ids]
        assert ids == hf_reference(prompt, n)
        res = msgs[-1].result
        assert res.usage.completion_tokens == n and res.usage.prompt_tokens == len(prompt)
        assert res.prefill_worker == "prefill-0" and res.decode_worker == "decode-0"
    wait_for(lambda: all_free(status(ep)), 2, "every block back after the burst")


def test_16_concurrent_http_requests_match_hf(cluster) -> None:
    _, ep = cluster
    work = mixed_prompts(16, seed=12)

    def one(pm: tuple[list[int], int]) -> Any:
        body = dict(
            model=MODEL, prompt=pm[0], max_tokens=pm[1], temperature=0, ignore_eos=True, return_token_ids=True
        )
        return httpx.post(f"{ep.http}/v1/completions", json=body, timeout=120)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, work))
    for (prompt, n), r in zip(work, results, strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == hf_reference(prompt, n)
        assert choice["prompt_token_ids"] == prompt


def test_openai_client_through_the_ray_cluster(cluster) -> None:
    import openai

    _, ep = cluster
    client = openai.OpenAI(base_url=f"{ep.http}/v1", api_key="unused")
    whole = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=0)
    parts = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in parts if c.choices) == whole.choices[0].text
    msgs: Any = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    streamed = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=5, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content


def long_body() -> dict[str, Any]:
    return dict(model=MODEL, prompt=list(range(3, 60)), max_tokens=LONG, temperature=0, ignore_eos=True)


def busy(ep: Any) -> bool:
    return any(w["running"] for w in status(ep)["workers"])


def test_http_disconnect_frees_blocks_on_both_workers(cluster) -> None:
    _, ep = cluster
    body = {**long_body(), "stream": True}
    with httpx.stream("POST", f"{ep.http}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert busy(ep)
    took = wait_for(lambda: all_free(status(ep)), 1.0, "blocks freed after the client disconnected")
    print(f"freed {took * 1000:.0f} ms after disconnect")
    r2 = httpx.post(f"{ep.http}/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 3})
    assert r2.status_code == 200


def test_grpc_cancel_frees_blocks(cluster) -> None:
    _, ep = cluster
    call = stub(ep).Generate(grpc_request(list(range(3, 60)), LONG, stream=True))
    for _ in range(3):
        next(call)
    assert busy(ep)
    call.cancel()
    wait_for(lambda: all_free(status(ep)), 1.0, "blocks freed after the gRPC cancel")
    [ok] = list(stub(ep).Generate(grpc_request([4, 5, 6], 3)))
    assert len(ok.chunk.token_ids) == 3


def test_grpc_deadline_frees_blocks(cluster) -> None:
    _, ep = cluster
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub(ep).Generate(grpc_request(list(range(3, 60)), LONG, stream=True), timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 2
    wait_for(lambda: all_free(status(ep)), 1.0, "blocks freed after the deadline")
    [ok] = list(stub(ep).Generate(grpc_request([4, 5, 6], 3)))
    assert len(ok.chunk.token_ids) == 3


def test_grpc_abort_rpc(cluster) -> None:
    _, ep = cluster
    req = grpc_request(list(range(3, 40)), LONG, stream=True)
    req.request_id = "abort-me"
    call = stub(ep).Generate(req)
    next(call)
    assert stub(ep).Abort(pb.AbortRequest(request_id="abort-me")).found
    last = list(call)[-1]
    assert last.result.finish_reason == pb.FINISH_REASON_ABORT
    wait_for(lambda: all_free(status(ep)), 1.0, "blocks freed after Abort", lambda: status(ep))


def test_killed_decode_worker_streams_move_and_the_pool_replaces_it() -> None:
    """SIGKILL of a decode worker under load: its streams continue on the survivor (request
    migration, on by default), and a fresh worker (its own Ray actor and placement group) takes
    the lost one's place; with the only prefill worker killed too, requests are served (the
    decode workers prefill them) until its replacement joins and takes prefills again."""
    st, ep = start_service(use_ray=True, prefill=1, decode=2, replace_lost=True)
    try:
        s = stub(ep)
        calls = []
        for i in range(4):
            req = grpc_request(list(range(3, 30 + i)), LONG, stream=True)
            req.request_id = f"victim-{i}"
            call = s.Generate(req)
            next(call)
            calls.append(call)
        http_body = {**long_body(), "stream": True, "return_token_ids": True}
        http_streams = [
            httpx.stream("POST", f"{ep.http}/v1/completions", json=http_body, timeout=60) for _ in range(2)
        ]
        http_lines = []
        for cm in http_streams:
            r = cm.__enter__()
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            http_lines.append(lines)
        decode0 = next(h for h in st.service.handles if h.worker_id == "decode-0")
        os.kill(decode0.info.pid, signal.SIGKILL)
        t0 = time.monotonic()
        outcomes = []
        for call in calls:
            try:
                msgs = list(call)
                outcomes.append(("ok", msgs[-1].result.decode_worker))
            except grpc.RpcError as e:
                outcomes.append((e.code().name, ""))
        for lines, cm in zip(http_lines, http_streams, strict=True):
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            cm.__exit__(None, None, None)
            errors = [e["error"] for e in events if "error" in e]
            tokens = sum(len(c.get("token_ids", [])) for e in events for c in e.get("choices", []))
            assert not errors, errors  # decode-0's streams moved to the survivor (migration) ...
            assert tokens == LONG - 1, tokens  # ... with nothing lost (the first token was read before)
        elapsed = time.monotonic() - t0
        assert all(o[1] == "decode-1" for o in outcomes), outcomes  # every gRPC stream ran to its end
        assert elapsed < 60, f"in-flight requests took {elapsed:.1f}s to end"

        def health() -> dict[str, str]:
            return {w["worker_id"]: w["health"] for w in status(ep)["workers"]}

        want = {"prefill-0": "healthy", "decode-1": "healthy", "decode-2": "healthy"}
        wait_for(lambda: health() == want, 60, "decode-2 in decode-0's place", health)
        assert status(ep)["ready"]
        seen = set()
        for i in range(6):
            p = [7, 8, 9 + i]
            [msg] = list(s.Generate(grpc_request(p, 4)))
            assert list(msg.chunk.token_ids) == hf_reference(p, 4)
            seen.add(msg.result.decode_worker)
        assert seen <= {"decode-1", "decode-2"}, seen
        # With the only prefill worker gone too, requests are still served (decode workers
        # prefill them) while its replacement starts; then prefills go to the replacement.
        prefill0 = next(h for h in st.service.handles if h.worker_id == "prefill-0")
        os.kill(prefill0.info.pid, signal.SIGKILL)
        wait_for(lambda: not prefill0.alive, 10, "prefill-0 seen dead")
        assert status(ep)["ready"]
        p = list(range(3, 40))
        [msg] = list(s.Generate(grpc_request(p, 5)))
        assert list(msg.chunk.token_ids) == hf_reference(p, 5)
        wait_for(lambda: health().get("prefill-1") == "healthy", 60, "prefill-1 joined", health)
        [msg] = list(s.Generate(grpc_request(p, 5)))
        assert msg.result.prefill_worker == "prefill-1"
        assert list(msg.chunk.token_ids) == hf_reference(p, 5)
        wait_for(lambda: all_free(status(ep)), 5.0, "blocks freed", lambda: status(ep))
        assert_no_request_state(st)
    finally:
        st.stop()


def open_streams(s: Any, seed: int, n: int) -> tuple[list[list[int]], list[tuple[Any, list[int]]]]:
    """``n`` greedy 200-token streams of random short prompts, each read to its first token:
    (prompts, (call, tokens so far) each)."""
    rng = random.Random(seed)
    ps = [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 60))] for _ in range(n)]
    calls = []
    for p in ps:
        call = s.Generate(grpc_request(p, 200, stream=True))
        calls.append((call, list(next(call).chunk.token_ids)))
    return ps, calls


def test_sigterm_to_the_only_decode_worker_refuses_nothing() -> None:
    """1P+1D (``make serve``'s layout): SIGTERM to the decode worker starts its replacement at
    once, and the draining worker serves new requests until the replacement takes them, so no
    request is refused meanwhile; its streams finish token-exact, then it exits."""
    st, ep = start_service(use_ray=True, prefill=1, decode=1, replace_lost=True)
    try:
        s = stub(ep)
        ps, calls = open_streams(s, seed=62, n=2)
        victim = next(h for h in st.service.handles if h.worker_id == "decode-0")
        router = st.service.router
        assert router is not None
        os.kill(victim.info.pid, signal.SIGTERM)
        wait_for(lambda: victim.load.health.value == "draining", 5.0, "decode-0 reports draining")

        def replaced() -> bool:
            return any(w.routable and w.worker_id != "decode-0" for w in router.workers.values()
                       if w.role.value == "decode")  # fmt: skip

        served: list[str] = []
        deadline = time.monotonic() + 90
        while not replaced() and time.monotonic() < deadline:
            [msg] = list(s.Generate(grpc_request([7, 8, 9], 4), timeout=30))  # UNAVAILABLE raises
            served.append(msg.result.decode_worker)
            time.sleep(0.2)
        assert replaced() and "decode-0" in served, served  # served while its replacement started
        [msg] = list(s.Generate(grpc_request([7, 8, 9], 4)))
        assert msg.result.decode_worker == "decode-1"
        for p, (call, tokens) in zip(ps, calls, strict=True):
            tokens += [t for m in call for t in m.chunk.token_ids]
            assert tokens == hf_reference(p, 200)

        def health() -> dict[str, str]:
            return {w["worker_id"]: w["health"] for w in status(ep)["workers"]}

        want = {"prefill-0": "healthy", "decode-1": "healthy"}
        wait_for(lambda: health() == want, 60, "decode-0 gone, decode-1 in its place", health)
        wait_for(lambda: all_free(status(ep)), 5.0, "blocks freed", lambda: status(ep))
        assert_no_request_state(st)
    finally:
        st.stop()


def test_sigterm_drains_a_decode_worker_then_the_pool_replaces_it() -> None:
    """SIGTERM to a decode worker's process: it reports DRAINING, gets no new requests, finishes
    its streams where they are (none moves), exits, and a fresh worker takes its place."""
    st, ep = start_service(use_ray=True, prefill=1, decode=2, replace_lost=True)
    try:
        s = stub(ep)
        ps, calls = open_streams(s, seed=61, n=4)
        victim = next(h for h in st.service.handles if h.worker_id == "decode-0")
        os.kill(victim.info.pid, signal.SIGTERM)
        wait_for(lambda: victim.load.health.value == "draining", 5.0, "decode-0 reports draining")
        [msg] = list(s.Generate(grpc_request([7, 8, 9], 4)))
        assert msg.result.decode_worker == "decode-1"
        on_victim = 0
        for p, (call, tokens) in zip(ps, calls, strict=True):
            msgs = list(call)
            tokens += [t for m in msgs for t in m.chunk.token_ids]
            assert tokens == hf_reference(p, 200)
            assert msgs[-1].result.migrations == 0
            on_victim += msgs[-1].result.decode_worker == "decode-0"
        assert on_victim >= 1

        def health() -> dict[str, str]:
            return {w["worker_id"]: w["health"] for w in status(ep)["workers"]}

        want = {"prefill-0": "healthy", "decode-1": "healthy", "decode-2": "healthy"}
        wait_for(lambda: health() == want, 60, "decode-2 in decode-0's place", health)
        with pytest.raises(ProcessLookupError):
            os.kill(victim.info.pid, 0)
        wait_for(lambda: all_free(status(ep)), 5.0, "blocks freed", lambda: status(ep))
        assert_no_request_state(st)
    finally:
        st.stop()
