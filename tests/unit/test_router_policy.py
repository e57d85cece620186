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
from pdserve.worker.messages import Logprob, TokenDelta, WorkerLoad, WorkerRole

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
    assert [e.token_ids for e in events if isinstance(e, Chunk)] == [(7, 8, 9)]  # unread: joined
    final = events[-1]
    assert isinstance(final, Final) and final.finish_reason == "length"
    assert final.usage.completion_tokens == 3 and final.usage.cached_tokens == 2
    assert final.timing.ttft_ms <= final.timing.e2e_ms


def test_stream_joins_only_the_chunks_its_reader_has_not_taken() -> None:
    """Chunks that arrive while the reader is busy (or together) come out as one chunk, text,
    ids and logprobs in order; one the reader already took is never held back."""
    lp = [Logprob(t, -0.5 * t, ((t, -0.5 * t),)) for t in range(5)]
    s = RequestStream("r", (1,), SamplingParams(max_tokens=5, logprobs=1), tokenizer=None)

    async def run() -> list[Chunk | Final]:
        got: list[Chunk | Final] = []
        reader = stream_reader(s, got)
        s.feed(TokenDelta("r", (0,), (lp[0],), prefilled=True))
        await asyncio.sleep(0)  # the reader takes it
        assert [e.token_ids for e in got if isinstance(e, Chunk)] == [(0,)]
        s.feed(TokenDelta("r", (1,), (lp[1],)))
        s.feed(TokenDelta("r", (2, 3), (lp[2], lp[3])))
        s.feed(TokenDelta("r", (4,), (lp[4],), finished=True, finish_reason="length"))
        await reader
        return got

    events = asyncio.run(run())
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert [c.token_ids for c in chunks] == [(0,), (1, 2, 3, 4)]
    assert [c.logprobs for c in chunks] == [(lp[0],), tuple(lp[1:])]
    assert isinstance(events[-1], Final) and events[-1].token_ids == (0, 1, 2, 3, 4)


def test_a_delta_of_several_tokens_shares_its_gap_among_them() -> None:
    """The gaps between tokens (the dispatcher learns decode's speed from their median) do not
    depend on how many steps a worker sent at once."""
    s = RequestStream("r", (1,), SamplingParams(max_tokens=6), tokenizer=None)
    s.feed(TokenDelta("r", (7,), prefilled=True))
    time.sleep(0.02)
    s.feed(TokenDelta("r", (8, 9, 10, 11)))
    assert len(s.itls) == 4 and len(set(s.itls)) == 1
    assert 0.02 / 4 <= s.itls[0] < 0.2 / 4


def stream_reader(s: RequestStream, into: list[Chunk | Final]) -> asyncio.Task[None]:
    async def read() -> None:
        async for ev in s.events():
            into.append(ev)

    return asyncio.ensure_future(read())


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
