"""Prompts queued on a prefill worker move when the pool grows, on a real (in-process)
deployment of emulated workers: a backlog sent to one prefill worker is shared with the one
that joins, and every request is served token-exact with nothing left behind."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from benchmarks.autoscale_live import moved
from pdserve.worker.messages import WorkerRole
from tests.service.helpers import (
    all_free,
    assert_no_request_state,
    grpc_request,
    start_service,
    status,
    stub,
    wait_for,
)

N_TOKENS = 4


def prompt(k: int) -> list[int]:
    """1,000 tokens, no prefix shared with another request's."""
    return [k % 200 + 20, *((7 * i + k) % 200 + 20 for i in range(999))]


def test_a_joined_prefill_worker_takes_part_of_the_backlog() -> None:
    # At 8x an H100's step times a 1,000-token prompt takes about 0.2 s: twenty of them are a
    # backlog of seconds, longer than a worker takes to start here.
    st, ep = start_service(False, prefill=1, decode=1, compute="emulated:h100-llama3-8b@x8")
    s = stub(ep)
    router = st.service.router
    assert router is not None
    try:

        def one(k: int) -> tuple[list[int], Any]:
            tokens: list[int] = []
            result = None
            for msg in s.Generate(grpc_request(prompt(k), N_TOKENS, stream=True), timeout=120):
                tokens.extend(msg.chunk.token_ids)
                if msg.HasField("result"):
                    result = msg.result
            return tokens, result

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            calls = [pool.submit(one, k) for k in range(20)]
            wait_for(lambda: len(router.workers["prefill-0"].inflight) >= 20, 30, "the backlog on prefill-0")
            t0 = time.monotonic()
            st.run(st.service.resize(WorkerRole.PREFILL, 2))
            served = [c.result() for c in calls]
        assert all(r is not None and len(t) == N_TOKENS for t, r in served)
        results = [r for _, r in served]
        # nothing arrived after the join: what prefill-1 served, it took from prefill-0's queue
        by = {w: sum(r.prefill_worker == w for r in results) for w in ("prefill-0", "prefill-1")}
        assert by["prefill-1"] >= 3, (by, time.monotonic() - t0)
        assert all(r.migrations == 0 for r in results)
        assert moved(ep.http)["prompts_rerouted"] == by["prefill-1"]
        # the same prompts again, with the pool at two: the same tokens
        assert [one(k)[0] for k in range(3)] == [t for t, _ in served[:3]]
        wait_for(lambda: all_free(status(ep)), 5, "blocks freed at the end")
        assert_no_request_state(st)
    finally:
        st.stop()


def test_a_prefill_worker_told_to_stop_hands_its_queue_to_the_others() -> None:
    """``drain`` (what SIGTERM starts in a worker process) on a prefill worker with a queue:
    the prompts it has not started go to the other prefill worker at once, so its drain ends
    after what it had started; every request is served, none fails or migrates."""
    import threading

    st, ep = start_service(False, prefill=2, decode=1, compute="emulated:h100-llama3-8b@x8")
    s = stub(ep)
    router = st.service.router
    assert router is not None
    try:
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            calls = [
                pool.submit(lambda k=k: list(s.Generate(grpc_request(prompt(k), N_TOKENS), timeout=120)))
                for k in range(20)
            ]
            handle = router.workers["prefill-0"]
            wait_for(lambda: len(handle.inflight) >= 8, 30, "a queue on prefill-0")
            drained: list[float] = []
            t0 = time.monotonic()
            host = handle.caller.host  # type: ignore[attr-defined]
            t = threading.Thread(target=lambda: host.drain(60) and drained.append(time.monotonic() - t0))
            t.start()
            results = [c.result()[-1].result for c in calls]
            t.join(60)
        # 8+ prompts of 0.2 s each were queued there: it left after the one or two it had started
        assert drained and drained[0] < 1.0, drained
        assert all(r.migrations == 0 and r.usage.completion_tokens == N_TOKENS for r in results)
        assert moved(ep.http)["prompts_rerouted"] >= 5
        assert_no_request_state(st)
    finally:
        st.stop()
