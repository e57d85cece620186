"""Role switching in place: a worker process of a deployment (``PoolWorker``) changes role
between prefill, decode and colocated while it holds no request, keeping its weights and KV
pool, well within a second; it serves token-exactly in every role and refuses to switch while
it holds a request."""

from __future__ import annotations

import time

import pytest

from pdserve.decode_worker.offline import OfflineDriver
from pdserve.deploy.pool_worker import PoolWorker
from pdserve.kvtransfer.config import TransportConfig
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.worker.commands import Abort, AddLocal, Prefill, UnsupportedCommand
from pdserve.worker.control import GetInfo, GetLoad, SwitchRole
from pdserve.worker.messages import WorkerRole, WorkItem
from pdserve.worker.spec import WorkerSpec
from tests.workers.test_role_engines import ENGINE, SECRET, prompts, run_disaggregated

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def no_recompute(*workers: PoolWorker) -> None:
    """Every transfer landed: nothing was recomputed for want of KV (which would hide a broken
    hand-off behind correct tokens)."""
    for w in workers:
        failed, recomputed = (getattr(w.engine, k, 0) for k in ("transfers_failed", "recomputed"))
        assert failed == 0 and recomputed == 0, w.spec.worker_id


def switch(w: PoolWorker, role: WorkerRole) -> float:
    t0 = time.perf_counter()
    info = w.control(SwitchRole(role))
    took = time.perf_counter() - t0
    assert info.role is role and w.control(GetInfo()).role is role and w.control(GetLoad()).role is role
    assert bool(info.address) is (role is WorkerRole.DECODE)  # only a decode worker receives KV
    return took


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_workers_swap_roles_and_serve_token_exactly(backend: str) -> None:
    tcfg = TransportConfig(backend=backend)
    a = PoolWorker(WorkerSpec("a", WorkerRole.PREFILL, ENGINE, tcfg, SECRET))
    b = PoolWorker(WorkerSpec("b", WorkerRole.DECODE, ENGINE, tcfg, SECRET))
    try:
        ps = prompts(4, seed=7)
        ref = [r.token_ids for r in OfflineDriver(ENGINE).generate(list(ps), [GREEDY] * len(ps))]
        items = [WorkItem(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
        got = run_disaggregated(a, b, items)
        assert [got[f"r{i}"] for i in range(len(ps))] == ref
        no_recompute(a, b)
        for w in (a, b):
            assert w.wait_idle(5.0)
        # The two swap roles; the one that was prefill now receives KV (it listens), and
        # the other sends it. Each switch is far below a second.
        took = [switch(a, WorkerRole.DECODE), switch(b, WorkerRole.PREFILL)]
        assert max(took) < 1.0, took
        with pytest.raises(UnsupportedCommand):
            a.execute(Prefill(items[0]))
        items = [WorkItem(f"s{i}", p, GREEDY) for i, p in enumerate(ps)]
        got = run_disaggregated(b, a, items)  # type: ignore[arg-type]
        assert [got[f"s{i}"] for i in range(len(ps))] == ref
        no_recompute(a, b)
        # Colocated and back: the KV pool (and its prefix cache) stayed, so a prompt this worker
        # computed as a decode worker is a prefix hit for its colocated engine.
        assert a.wait_idle(5.0)
        assert switch(a, WorkerRole.COLOCATED) < 1.0
        a.run(AddLocal(WorkItem("c0", ps[0], GREEDY)))
        tokens, cached = [], 0
        deadline = time.monotonic() + 30
        while len(tokens) < GREEDY.max_tokens:
            assert time.monotonic() < deadline
            for d in a.collect(0.05).deltas:
                tokens.extend(d.token_ids)
                cached = max(cached, d.num_cached_tokens)
        assert tokens == ref[0] and cached > 0
        assert a.wait_idle(5.0)
        assert switch(a, WorkerRole.PREFILL) < 1.0
        for w in (a, b):
            assert w.wait_idle(5.0)
            w.check_integrity()
    finally:
        a.shutdown()
        b.shutdown()


def test_a_worker_holding_a_request_does_not_switch() -> None:
    w = PoolWorker(WorkerSpec("w", WorkerRole.COLOCATED, ENGINE, TransportConfig(), SECRET))
    try:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        w.run(AddLocal(WorkItem("busy", tuple(range(1, 40)), long)))
        with pytest.raises(ValueError, match="drain it"):
            w.control(SwitchRole(WorkerRole.PREFILL))
        assert w.control(GetInfo()).role is WorkerRole.COLOCATED
        assert w.run(Abort("busy"))
        assert w.wait_idle(5.0)
        switch(w, WorkerRole.PREFILL)
        with pytest.raises(ValueError):
            w.switch_role("router")
        w.check_integrity()
    finally:
        w.shutdown()


def test_a_switched_worker_tells_its_routers_the_cache_it_kept() -> None:
    """The routers drop their view of a worker's prefix cache when it leaves its pool; the cache
    stays through the switch, so the worker's next events are a snapshot of it."""
    w = PoolWorker(WorkerSpec("w", WorkerRole.COLOCATED, ENGINE, TransportConfig(), SECRET))
    try:
        w.run(AddLocal(WorkItem("c", tuple(range(1, 40)), GREEDY)))
        assert w.wait_idle(5.0)
        taken = w.loop.take_kv_events()
        assert taken is not None and taken.snapshot is None and taken.ops  # ops, as ever
        switch(w, WorkerRole.PREFILL)
        after = w.loop.take_kv_events()
        kept = set(w.loop.call(lambda: w.engine.kv.pool.cached_keys()))
        assert after is not None and after.ops == () and set(after.snapshot or ()) == kept != set()
        assert w.loop.take_kv_events() is None  # then ops again
    finally:
        w.shutdown()
