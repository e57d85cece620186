"""Planned pool changes under router replicas (in-process workers, two replica processes): the
pool owner retires a decode worker that holds a replica's stream (the stream finishes there,
the replicas route nothing new to it meanwhile), and a role switch that would cut a replica's
stream short is given up, the worker serving on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.worker.messages import WorkerHealth, WorkerRole
from tests.service.helpers import assert_no_request_state, grpc_request, start_service, stub, wait_for

LONG = 1500  # tokens: a stream that outlasts the checks below


@pytest.fixture(scope="module")
def replicated() -> Iterator[Any]:
    st, ep = start_service(use_ray=False, prefill=1, decode=2, routers=2)
    yield st, ep
    st.stop()


def holding(st: Any) -> list[str]:
    """Decode workers holding a replica's request (as the owner sees their loads)."""
    return [
        w.worker_id for w in st.service.router.workers.values()
        if w.role is WorkerRole.DECODE and w.load.others.decodes
    ]  # fmt: skip


def start_long(ep: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        out.extend(stub(ep).Generate(grpc_request(list(range(10, 40)), LONG, stream=True), timeout=120))

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_retiring_a_worker_waits_for_a_replicas_stream_and_routes_nothing_new_to_it(replicated) -> None:
    st, ep = replicated
    t, out = start_long(ep)
    wait_for(lambda: len(holding(st)) == 1, 30, "the stream on a decode worker")
    [victim] = holding(st)
    router = st.service.router
    retire = asyncio.run_coroutine_threadsafe(router.membership.retire(victim, 60.0), st.loop)
    wait_for(
        lambda: router.workers[victim].load.health is WorkerHealth.DRAINING, 10, "the worker says it leaves"
    )
    for _ in range(6):  # new requests, on either replica: none goes to the leaving worker
        [*_, last] = stub(ep).Generate(grpc_request([5, 6, 7, 8], 4), timeout=60)
        assert last.result.decode_worker != victim
    assert not retire.done()  # it waits for the replica's stream
    t.join(120)
    change = retire.result(60)
    assert change.done and change.moved == 0, change
    assert sum(len(m.chunk.token_ids) for m in out) == LONG and out[-1].result.decode_worker == victim
    st.service.handles = [h for h in st.service.handles if h.worker_id in router.workers]
    asyncio.run_coroutine_threadsafe(st.service.resize(WorkerRole.DECODE, 2), st.loop).result(120)
    assert_no_request_state(st)


def test_a_switch_that_would_cut_a_replicas_stream_is_given_up(replicated) -> None:
    st, ep = replicated
    wait_for(lambda: sum(w.routable for w in st.service.router.workers.values()) == 3, 60, "the pool whole")
    t, out = start_long(ep)
    wait_for(lambda: len(holding(st)) == 1, 30, "the stream on a decode worker")
    [victim] = holding(st)
    change = st.run(st.service.switch_role(victim, WorkerRole.PREFILL, drain_timeout_s=0.3))
    assert not change.done and "router replicas" in change.why_not, change
    t.join(120)
    assert sum(len(m.chunk.token_ids) for m in out) == LONG  # the stream finished where it was
    w = st.service.router.workers[victim]
    wait_for(lambda: w.load.health is WorkerHealth.HEALTHY and w.routable, 10, "the worker serving again")
    assert_no_request_state(st)
