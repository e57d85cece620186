"""Prompts queued on a prefill worker move when the pool grows, on a real (in-process)
deployment of emulated workers: a backlog sent to one prefill worker is shared with the one
that joins, and every request is served token-exact with nothing left behind."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx

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
        metrics = httpx.get(f"{ep.http}/metrics", timeout=10).text
        counter = "pdserve:prefill_rerouted_total"
        moved = next(line for line in metrics.splitlines() if line.startswith(counter))
        assert float(moved.split()[-1]) == by["prefill-1"]
        # the same prompts again, with the pool at two: the same tokens
        assert [one(k)[0] for k in range(3)] == [t for t, _ in served[:3]]
        wait_for(lambda: all_free(status(ep)), 5, "blocks freed at the end")
        assert_no_request_state(st)
    finally:
        st.stop()
