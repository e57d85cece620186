"""Routing policies and the router's per-request stream, without any server."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.router.dispatchers import make_dispatcher
from pdserve.router.errors import Code, RouterError
from pdserve.router.policy import LeastLoaded, RoundRobin, RouteRequest
from pdserve.router.stream import Chunk, Final, RequestStream
from pdserve.worker.messages import TokenDelta, WorkerLoad, WorkerRole

REQ = RouteRequest(prompt_tokens=10, max_tokens=5)


def load(wid: str, running: int = 0, waiting: int = 0, free: int = 100) -> WorkerLoad:
    return WorkerLoad(wid, WorkerRole.DECODE, "", running, waiting, 100, free, 0)


def test_round_robin_cycles_in_id_order() -> None:
    rr = RoundRobin()
    ws = [load("b"), load("a"), load("c")]
    assert [rr.choose(ws, REQ) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_prefers_idle_then_free_kv_and_counts_unreported_sends() -> None:
    ll = LeastLoaded()
    ws = [load("a", running=3), load("b", running=1, free=10), load("c", running=1, free=50)]
    assert ll.choose(ws, REQ) == "c"
    assert ll.choose(ws, REQ) == "b"  # c counts the request sent since its last report
    ll.note_report("c")
    assert ll.choose(ws, REQ) == "c"


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        make_dispatcher("fastest")


def drain(stream: RequestStream) -> list[Chunk | Final]:
    async def run() -> list[Chunk | Final]:
        return [ev async for ev in stream.events()]

    return asyncio.run(run())


def test_stream_collects_tokens_in_order_and_reports_usage() -> None:
    s = RequestStream("r", (1, 2, 3), SamplingParams(max_tokens=3), tokenizer=None)
    s.feed(TokenDelta("r", (7,), prefilled=True, num_cached_tokens=2))
    s.feed(TokenDelta("r", (8, 9), finished=True, finish_reason="length"))
    s.feed(TokenDelta("r", (10,)))  # late duplicate after the end: ignored
    events = drain(s)
    assert [e.token_ids for e in events if isinstance(e, Chunk)] == [(7,), (8, 9)]
    final = events[-1]
    assert isinstance(final, Final) and final.finish_reason == "length"
    assert final.usage.completion_tokens == 3 and final.usage.cached_tokens == 2
    assert final.timing.ttft_ms <= final.timing.e2e_ms


def test_queue_time_never_exceeds_ttft() -> None:
    """The answer saying prefill took the prompt in can be seen after its first token (they
    travel apart): queue_ms still ends no later than the first token."""
    s = RequestStream("r", (1, 2), SamplingParams(max_tokens=2), tokenizer=None)
    s.feed(TokenDelta("r", (7,), prefilled=True))
    time.sleep(0.002)
    s.taken_in()  # the Prefill command's answer, read after the token
    s.feed(TokenDelta("r", (8,), finished=True, finish_reason="length"))
    t = drain(s)[-1].timing  # type: ignore[union-attr]
    assert 0 < t.queue_ms <= t.ttft_ms <= t.e2e_ms
    s = RequestStream("r", (1, 2), SamplingParams(max_tokens=2), tokenizer=None)
    s.taken_in()
    time.sleep(0.002)
    s.feed(TokenDelta("r", (7, 8), finished=True, finish_reason="length"))
    t = drain(s)[-1].timing  # type: ignore[union-attr]
    assert t.queue_ms < t.ttft_ms - 1  # taken in first: its own time


def test_stream_failure_raises_for_the_reader() -> None:
    s = RequestStream("r", (1,), SamplingParams(), tokenizer=None)
    s.feed(TokenDelta("r", (4,)))
    s.fail(RouterError(Code.UNAVAILABLE, "worker died"))
    with pytest.raises(RouterError) as e:
        drain(s)
    assert e.value.code is Code.UNAVAILABLE
