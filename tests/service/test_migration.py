"""Request migration: when a decode worker is lost mid-stream, each of its streams goes on on
another decode worker (prompt + the tokens already sent, recomputed there): nothing dropped,
nothing repeated, greedy output identical to the HF reference and seeded output identical to an
unfaulted run; with ``--migration-limit 0`` those streams fail UNAVAILABLE with the reason."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from pdserve.router.service import Router
from pdserve.v1 import inference_pb2 as pb
from pdserve.worker.messages import WorkerRole
from tests.service.helpers import (
    assert_no_request_state,
    grpc_request,
    hf_reference,
    start_service,
    stub,
    wait_for,
)

pytest.importorskip("transformers")

N_TOKENS = 160


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def start_streams(s: Any, ps: list[list[int]], **sampling: Any) -> list[tuple[Any, list[int]]]:
    """Open one stream per prompt and read each until it has produced a few tokens."""
    calls = []
    for p in ps:
        call = s.Generate(grpc_request(p, N_TOKENS, stream=True, **sampling))
        got: list[int] = []
        while len(got) < 3:
            got.extend(next(call).chunk.token_ids)
        calls.append((call, got))
    return calls


def finish(calls: list[tuple[Any, list[int]]]) -> list[tuple[list[int], Any]]:
    out = []
    for call, got in calls:
        tokens = list(got)
        result = None
        for msg in call:
            tokens.extend(msg.chunk.token_ids)
            if msg.HasField("result"):
                result = msg.result
        out.append((tokens, result))
    return out


def assert_moved_token_exact(ps: list[list[int]], results: list[tuple[list[int], Any]], to: str) -> None:
    """Every stream finished on ``to`` with the reference's tokens (nothing lost, nothing
    repeated), and at least one of them moved there."""
    moved = 0
    for p, (tokens, result) in zip(ps, results, strict=True):
        assert result is not None and result.finish_reason == pb.FINISH_REASON_LENGTH
        assert tokens == hf_reference(p, N_TOKENS)
        assert result.decode_worker == to
        moved += result.migrations
    assert moved >= 1, "no stream moved"


def one_prefill_two_decode() -> tuple[Any, Any, Router]:
    """An in-process 1 prefill + 2 decode service, its gRPC stub and its router."""
    st, ep = start_service(use_ray=False, prefill=1, decode=2)
    assert st.service.router is not None
    return st, stub(ep), st.service.router


def kill(st: Any, worker_id: str) -> None:
    handle = next(h for h in st.service.handles if h.worker_id == worker_id)
    handle.caller.kill()  # its channel ends: the router sees it lost
    wait_for(lambda: not handle.alive, 5.0, f"{worker_id} seen lost")


def test_streams_of_a_lost_decode_worker_finish_elsewhere_token_exact() -> None:
    st, ep = start_service(use_ray=False, prefill=1, decode=2)
    try:
        s = stub(ep)
        ps = prompts(6, seed=51)
        calls = start_streams(s, ps)
        kill(st, "decode-0")
        assert_moved_token_exact(ps, finish(calls), "decode-1")
        assert_no_request_state(st)
    finally:
        st.stop()


def test_a_seeded_stream_is_the_same_with_and_without_the_fault() -> None:
    p = prompts(1, seed=52)[0]
    sampling = dict(temperature=0.9, seed=77)
    runs = []
    for faulted in (False, True):
        st, ep = start_service(use_ray=False, prefill=1, decode=2)
        try:
            s = stub(ep)
            # Two streams, so that one is on decode-0 whichever way the router places them.
            calls = start_streams(s, [p, p], **sampling)
            if faulted:
                kill(st, "decode-0")
            done = finish(calls)
            runs.append([tokens for tokens, _ in done])
            moved = sum(r.migrations for _, r in done if r is not None)
            assert moved == (1 if faulted else 0)
        finally:
            st.stop()
    assert runs[0][0] == runs[0][1]  # the seed decides, not the worker
    assert runs[1] == runs[0]


def test_without_migration_the_lost_workers_streams_fail_with_the_reason() -> None:
    st, ep = start_service(use_ray=False, prefill=1, decode=2, migration_limit=0)
    try:
        s = stub(ep)
        calls = start_streams(s, prompts(4, seed=53))

        def drain(call: Any) -> tuple[grpc.RpcError | None, float]:
            try:
                list(call)
            except grpc.RpcError as e:
                return e, time.monotonic()
            return None, time.monotonic()

        # Each stream is read on its own thread: gRPC delivers a stream's status only once its
        # buffered messages are read, so reading them one after another would time the survivors.
        with ThreadPoolExecutor(len(calls)) as pool:
            readers = [pool.submit(drain, call) for call, _ in calls]
            t0 = time.monotonic()
            kill(st, "decode-0")
            ends = [r.result() for r in readers]
        failed = [t - t0 for e, t in ends if e is not None]
        for e, _ in ends:
            if e is not None:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                assert "migration" in str(e.details()), e.details()
        assert failed
        # the lost worker's streams end at once, not at a timeout
        assert max(failed) < 1.0, failed
    finally:
        st.stop()


def test_a_silent_worker_is_detected_and_its_streams_move() -> None:
    """A decode worker that stops sending anything (a stopped or wedged process: here its
    channel's writer blocks) is lost within the liveness timeout, its streams finish on the
    other decode worker token-exact, and its late frames, once it wakes, reach no client."""
    import threading

    st, ep = start_service(use_ray=False, prefill=1, decode=2)
    wake = threading.Event()
    try:
        s = stub(ep)
        ps = prompts(4, seed=54)
        calls = start_streams(s, ps)
        handle = next(h for h in st.service.handles if h.worker_id == "decode-0")
        pusher = handle.caller.host.pusher  # type: ignore[attr-defined]
        send = pusher._send
        pusher._send = lambda data: (wake.wait(), send(data))  # nothing leaves the worker
        t0 = time.monotonic()
        wait_for(lambda: not handle.alive, 8.0, "decode-0 seen lost")
        detected = time.monotonic() - t0
        assert detected <= 5.0, detected
        results = finish(calls)
        for p, (tokens, result) in zip(ps, results, strict=True):
            assert tokens == hf_reference(p, N_TOKENS)
            assert result is not None and result.decode_worker == "decode-1"
        assert sum(r.migrations for _, r in results if r is not None) >= 1
    finally:
        wake.set()
        st.stop()


def test_requests_of_a_prefill_worker_lost_before_their_first_token_are_redispatched() -> None:
    """The prefill worker dies with prompts still queued: those requests are dispatched again
    (no token was sent, so anywhere a new request could go) and finish HF-exact."""
    st, ep = start_service(use_ray=False, prefill=1, decode=1)
    try:
        s = stub(ep)
        rng = random.Random(55)
        ps = [[rng.randrange(3, 256) for _ in range(900)] for _ in range(6)]  # queued on prefill
        calls = [s.Generate(grpc_request(p, 12, stream=True)) for p in ps]
        kill(st, "prefill-0")
        results = finish([(c, []) for c in calls])
        for p, (tokens, result) in zip(ps, results, strict=True):
            assert result is not None and result.finish_reason == pb.FINISH_REASON_LENGTH
            assert tokens == hf_reference(p, 12)
        assert sum(r.migrations for _, r in results if r is not None) >= 1
        assert_no_request_state(st)
    finally:
        st.stop()


def test_a_lost_worker_is_replaced_and_its_replacement_serves() -> None:
    """With ``replace_lost`` (the product default) a fresh worker joins in place of a lost one:
    the lost worker's streams move to the survivor at once, and once the replacement's channel
    is up it takes new requests; nothing leaks anywhere."""
    st, ep = start_service(use_ray=False, prefill=1, decode=2, replace_lost=True)
    try:
        s = stub(ep)
        ps = prompts(4, seed=56)
        calls = start_streams(s, ps)
        kill(st, "decode-0")
        for p, (tokens, result) in zip(ps, finish(calls), strict=True):
            assert tokens == hf_reference(p, N_TOKENS)
            assert result is not None and result.decode_worker == "decode-1"
        router = st.service.router
        assert router is not None
        wait_for(lambda: "decode-2" in router.workers and router.workers["decode-2"].routable, 30,
                 "decode-2 joined", lambda: {w: h.health for w, h in router.workers.items()})  # fmt: skip
        assert "decode-0" not in router.workers
        assert [h.worker_id for h in st.service.handles] == ["prefill-0", "decode-1", "decode-2"]
        ps = prompts(6, seed=57)
        results = finish(start_streams(s, ps))
        assert {r.decode_worker for _, r in results if r is not None} == {"decode-1", "decode-2"}
        for p, (tokens, _) in zip(ps, results, strict=True):
            assert tokens == hf_reference(p, N_TOKENS)
        assert_no_request_state(st)
    finally:
        st.stop()


def test_a_draining_worker_finishes_its_streams_and_gets_no_new_ones() -> None:
    """``drain`` (what SIGTERM starts in a worker process): the worker reports DRAINING, the
    router sends it nothing new, and its own streams finish there, unmoved and token-exact."""
    import threading

    st, ep = start_service(use_ray=False, prefill=1, decode=2)
    try:
        s = stub(ep)
        ps = prompts(4, seed=58)
        calls = start_streams(s, ps)
        handle = next(h for h in st.service.handles if h.worker_id == "decode-0")
        drained: list[bool] = []
        t = threading.Thread(target=lambda: drained.append(handle.caller.host.drain(60)))  # type: ignore[attr-defined]
        t.start()
        wait_for(lambda: not handle.routable, 5.0, "decode-0 seen draining")
        assert handle.alive
        for p in prompts(3, seed=59):
            [msg] = list(s.Generate(grpc_request(p, 4)))
            assert msg.result.decode_worker == "decode-1"
        results = finish(calls)
        t.join(60)
        assert drained == [True]
        for p, (tokens, result) in zip(ps, results, strict=True):
            assert tokens == hf_reference(p, N_TOKENS)
            assert result is not None and result.migrations == 0
        assert {r.decode_worker for _, r in results if r is not None} >= {"decode-0"}
        assert_no_request_state(st)
    finally:
        st.stop()


def test_pools_grow_and_shrink_under_load_without_failing_a_request() -> None:
    """``Service.resize``: a decode worker retired under load (a short drain, so some streams
    must move) fails nothing; a new one joins and takes requests; with the prefill pool at zero,
    decode workers prefill requests themselves. Everything HF-exact, nothing left anywhere."""
    st, s, router = one_prefill_two_decode()
    try:
        ps = prompts(6, seed=60)
        calls = start_streams(s, ps)
        held = {w: len(router.workers[w].inflight) for w in ("decode-0", "decode-1")}
        assert all(held.values()), held
        st.run(st.service.resize(WorkerRole.DECODE, 1, drain_timeout_s=0.2))
        results = finish(calls)
        for p, (tokens, result) in zip(ps, results, strict=True):
            assert tokens == hf_reference(p, N_TOKENS)
            assert result is not None
        assert sum(r.migrations for _, r in results if r is not None) >= 1  # the drain was too short
        decode = sorted(w for w, h in router.workers.items() if h.role is WorkerRole.DECODE)
        assert len(decode) == 1 and len(st.service.handles) == 2
        st.run(st.service.resize(WorkerRole.DECODE, 2))
        assert "decode-2" in router.workers and router.workers["decode-2"].routable
        st.run(st.service.resize(WorkerRole.PREFILL, 0))
        assert not [h for h in router.workers.values() if h.role is WorkerRole.PREFILL]
        ps = prompts(4, seed=61)
        results = finish(start_streams(s, ps))
        for p, (tokens, result) in zip(ps, results, strict=True):
            assert tokens == hf_reference(p, N_TOKENS)
            assert result is not None and result.prefill_worker == ""
        assert "decode-2" in {r.decode_worker for _, r in results if r is not None}
        with pytest.raises(ValueError, match="cannot serve"):
            st.run(st.service.resize(WorkerRole.DECODE, 0))
        with pytest.raises(ValueError, match="no colocated pool"):
            st.run(st.service.resize(WorkerRole.COLOCATED, 1))
        assert_no_request_state(st)
    finally:
        st.stop()


def test_a_role_switch_under_load_fails_nothing_and_takes_under_a_second() -> None:
    """A decode worker becomes a prefill worker under load (drained for 0.3 s, what is left
    moved, switched in place) within a second, with every stream HF-exact; the new prefill
    worker then takes prefills, and the switch back works the same way."""
    st, s, router = one_prefill_two_decode()
    try:
        ps = prompts(6, seed=62)
        calls = start_streams(s, ps)
        t0 = time.monotonic()
        st.run(st.service.switch_role("decode-1", WorkerRole.PREFILL, drain_timeout_s=0.3))
        took = time.monotonic() - t0
        assert took < 1.0, took
        assert router.workers["decode-1"].role is WorkerRole.PREFILL and router.workers["decode-1"].routable
        for p, (tokens, result) in zip(ps, finish(calls), strict=True):
            assert tokens == hf_reference(p, N_TOKENS)
            assert result is not None and result.decode_worker == "decode-0"  # moved there, or there
        with pytest.raises(ValueError, match="last decode"):
            st.run(st.service.switch_role("decode-0", WorkerRole.PREFILL))
        ps = prompts(8, seed=63)
        results = finish(start_streams(s, ps))
        assert "decode-1" in {r.prefill_worker for _, r in results if r is not None}
        for p, (tokens, _) in zip(ps, results, strict=True):
            assert tokens == hf_reference(p, N_TOKENS)
        st.run(st.service.switch_role("decode-1", WorkerRole.DECODE, drain_timeout_s=1.0))
        ps = prompts(6, seed=64)
        results = finish(start_streams(s, ps))
        assert {r.decode_worker for _, r in results if r is not None} == {"decode-0", "decode-1"}
        assert_no_request_state(st)
    finally:
        st.stop()


def test_http_streams_say_how_often_they_moved() -> None:
    """Over HTTP too the final chunk of a moved stream says how often it moved (an extension
    field, only present when it did), and the stream is complete."""
    import json

    import httpx

    st, _, _ = one_prefill_two_decode()
    try:
        ep = st.service.endpoints
        body = {"model": "tiny", "prompt": list(range(3, 30)), "max_tokens": N_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
        streams = [httpx.stream("POST", f"{ep.http}/v1/completions", json=body, timeout=60) for _ in range(4)]
        lines = []
        for cm in streams:
            r = cm.__enter__()
            assert r.status_code == 200
            it = r.iter_lines()
            next(line for line in it if line.startswith("data: {"))  # a first chunk: it runs
            lines.append(it)
        kill(st, "decode-0")
        moved = []
        for it, cm in zip(lines, streams, strict=True):
            events = [json.loads(x[6:]) for x in it if x.startswith("data: {")]
            cm.__exit__(None, None, None)
            final = next(c for e in events for c in e["choices"] if c.get("finish_reason"))
            assert final["finish_reason"] == "length"
            moved.append(final.get("migrations", 0))
        assert sum(moved) >= 1 and set(moved) <= {0, 1}, moved
        assert_no_request_state(st)
    finally:
        st.stop()
