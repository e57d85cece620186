"""Prefill and decode workers in one process (no Ray): the disaggregated path end to end through
real KV transfers must give exactly the colocated engine's tokens and leak no blocks."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.decode_worker.actor import DecodeWorker
from pdserve.decode_worker.offline import OfflineDriver
from pdserve.kvtransfer.config import TransportConfig
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.engine.step_log import read_steps
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.prefill_worker.actor import PrefillWorker
from pdserve.worker.commands import (
    Abort,
    AwaitReservation,
    KvLost,
    Prefill,
    QueueReservation,
    SetTarget,
    Start,
)
from pdserve.worker.loop import WorkerFailed
from pdserve.worker.messages import KVTarget, TokenDelta, WorkerRole, WorkItem
from pdserve.worker.spec import WorkerSpec

SECRET = b"worker-test-secret-0123"
ENGINE = EngineConfig(
    model="tiny", cache=CacheConfig(block_size=8, num_blocks=96), scheduler=SchedulerConfig(64, 16)
)


def prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(1, 250) for _ in range(rng.randrange(3, 70))) for _ in range(n)]


@pytest.fixture(params=["tcp", "shm", "shm+overlap"])
def pair(request: pytest.FixtureRequest):
    backend, _, overlap = request.param.partition("+")
    tcfg = TransportConfig(backend=backend)
    p = PrefillWorker(WorkerSpec("p0", WorkerRole.PREFILL, ENGINE, tcfg, SECRET))
    decode = dataclasses.replace(ENGINE, overlap="on" if overlap else "off")
    d = DecodeWorker(WorkerSpec("d0", WorkerRole.DECODE, decode, tcfg, SECRET))
    yield p, d
    for w in (p, d):
        assert w.wait_idle(5.0), f"{w.spec.worker_id} still holds requests"
        w.check_integrity()
        w.shutdown()


def reserve(d: DecodeWorker, work: WorkItem, transfer_id: str, timeout_s: float) -> KVTarget | None:
    """Queue a reservation and wait for its outcome, as the router does: the target once
    granted, ``None`` if refused or expired."""
    if not d.run(QueueReservation(work, transfer_id, timeout_s)):
        return None
    target = d.run(AwaitReservation(work.request_id), timeout_s + 30.0)  # the engine's deadline rules
    return target if isinstance(target, KVTarget) else None


def run_disaggregated(
    p: PrefillWorker, d: DecodeWorker, items: list[WorkItem], abort_after: dict[str, int] | None = None
) -> dict[str, list[int]]:
    """A minimal router: reserve, prefill, start on the first token, collect until finished."""
    out: dict[str, list[int]] = {w.request_id: [] for w in items}
    done: set[str] = set()
    for w in items:
        target = reserve(d, w, f"t-{uuid.uuid4().hex}", timeout_s=10)
        assert target is not None
        p.run(Prefill(w, target))
    deadline = time.monotonic() + 60
    while len(done) < len(items):
        assert time.monotonic() < deadline, f"unfinished: {set(out) - done}"
        for worker in (p, d):
            for delta in worker.collect(0.01).deltas:
                handle(delta, p, d, out, done, abort_after or {})
    return out


def handle(delta: TokenDelta, p, d, out, done, abort_after) -> None:  # type: ignore[no-untyped-def]
    rid = delta.request_id
    if rid in done:
        return
    assert delta.error is None, delta.error
    out[rid].extend(delta.token_ids)
    if delta.prefilled:
        assert d.run(Start(rid, delta.token_ids[0], delta.num_cached_tokens))
    if delta.finished:
        if delta.prefilled is False and len(out[rid]) == 1 and delta.token_ids:
            d.run(Abort(rid))  # the first token ended it on the prefill worker
        done.add(rid)
    elif rid in abort_after and len(out[rid]) >= abort_after[rid]:
        d.run(Abort(rid))
        p.run(Abort(rid))
        done.add(rid)


def test_disaggregated_matches_colocated(pair) -> None:
    p, d = pair
    ps = prompts(10)
    params = [SamplingParams(max_tokens=1 + i * 3, temperature=0.0, ignore_eos=True) for i in range(10)]
    ref = OfflineDriver(ENGINE).generate(list(ps), params)
    items = [WorkItem(f"r{i}", pr, pa) for i, (pr, pa) in enumerate(zip(ps, params, strict=True))]
    got = run_disaggregated(p, d, items)
    for i, r in enumerate(ref):
        assert got[f"r{i}"] == r.token_ids, f"request {i}"
    assert d.engine.transfers_failed == 0 and d.engine.recomputed == 0  # type: ignore[attr-defined]
    # r0 ended on its first token; its push may still have completed before the cancel.
    assert p.transport is not None and p.transport.stats.transfers_sent >= 9


def test_step_logs_record_each_workers_steps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--step-log``: each worker logs its own forward steps, prompts on prefill, one token per
    request per step on decode, on one clock (a request's decode steps follow its prefill)."""
    eng = dataclasses.replace(ENGINE, step_log=str(tmp_path))
    tcfg = TransportConfig(backend="shm")
    p = PrefillWorker(WorkerSpec("p0", WorkerRole.PREFILL, eng, tcfg, SECRET))
    d = DecodeWorker(WorkerSpec("d0", WorkerRole.DECODE, eng, tcfg, SECRET))
    try:
        ps = prompts(3, seed=5)
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        run_disaggregated(p, d, [WorkItem(f"s{i}", pr, params) for i, pr in enumerate(ps)])
        assert p.wait_idle(5.0) and d.wait_idle(5.0)
    finally:
        p.shutdown()
        d.shutdown()
    pre, dec = read_steps(tmp_path / "p0.jsonl"), read_steps(tmp_path / "d0.jsonl")
    # chunked or whole, every prompt token is computed once (distinct prompts: no cache hits)
    assert sum(n for r in pre for n, _ in r.chunks) == sum(len(x) for x in ps)
    assert all(r.has_prefill for r in pre) and not any(r.has_prefill for r in dec)
    assert sum(len(r.chunks) for r in dec) == 3 * 4  # 4 decode tokens each after the first
    assert min(r.start for r in dec) > min(r.end for r in pre)


def test_seeded_sampling_matches_colocated(pair) -> None:
    p, d = pair
    ps = prompts(4, seed=3)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i) for i in range(4)]
    ref = OfflineDriver(ENGINE).generate(list(ps), params)
    items = [WorkItem(f"s{i}", pr, pa) for i, (pr, pa) in enumerate(zip(ps, params, strict=True))]
    got = run_disaggregated(p, d, items)
    for i, r in enumerate(ref):
        assert got[f"s{i}"] == r.token_ids


def test_abort_mid_decode_frees_both_sides(pair) -> None:
    p, d = pair
    ps = prompts(6, seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    items = [WorkItem(f"a{i}", pr, params) for i, pr in enumerate(ps)]
    got = run_disaggregated(p, d, items, abort_after={"a0": 2, "a3": 5})
    assert len(got["a1"]) == 40
    assert d.wait_idle(5.0) and p.wait_idle(5.0)
    assert d.load().kv_free == d.load().kv_total


def test_abort_before_transfer_releases_reservation(pair) -> None:
    _, d = pair
    w = WorkItem("x", prompts(1)[0], SamplingParams(max_tokens=4))
    target = reserve(d, w, "t-x", timeout_s=5)
    assert target is not None and d.load().kv_free < d.load().kv_total
    assert d.run(Abort("x"))
    assert d.wait_idle(5.0)
    assert d.load().kv_free == d.load().kv_total


def test_failed_transfer_is_recomputed_on_decode() -> None:
    """A prefill worker that dies after prefilling: decode recomputes from prompt + first token."""
    tcfg = TransportConfig(backend="tcp", lease_s=0.3)
    d = DecodeWorker(WorkerSpec("d0", WorkerRole.DECODE, ENGINE, tcfg, SECRET))
    try:
        pr = prompts(1, seed=9)[0]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        ref = OfflineDriver(ENGINE).generate([pr], params)[0].token_ids
        assert reserve(d, WorkItem("f", pr, params), "t-f", timeout_s=5) is not None
        assert d.run(Start("f", ref[0], 0))  # nobody pushes: the lease expires, decode recomputes
        toks = [ref[0]]
        deadline = time.monotonic() + 20
        while len(toks) < 8:
            assert time.monotonic() < deadline
            for delta in d.collect(0.05).deltas:
                toks.extend(delta.token_ids)
        assert toks == ref
        assert d.engine.recomputed == 1  # type: ignore[attr-defined]
        assert d.wait_idle(5.0)
        d.check_integrity()
    finally:
        d.shutdown()


def test_target_after_prefill_and_aborts_of_unknown_ids(pair) -> None:
    """The router sends prefill and reserve at once: the KV target may come after the first
    token (then the whole KV goes in one push). An abort for an id a worker does not hold
    leaves no trace (commands arrive in order, so it never overtakes its add)."""
    p, d = pair
    pr = prompts(1, seed=21)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = OfflineDriver(ENGINE).generate([pr], params)[0].token_ids
    w = WorkItem("late", pr, params)
    p.run(Prefill(w))  # no target yet
    first: list[TokenDelta] = []
    deadline = time.monotonic() + 10
    while not first:
        assert time.monotonic() < deadline
        first = [x for x in p.collect(0.05).deltas if x.request_id == "late"]
    assert first[0].prefilled and first[0].token_ids == (ref[0],)
    target = reserve(d, w, "t-late", timeout_s=5)
    assert target is not None and p.run(SetTarget("late", target))
    assert d.run(Start("late", ref[0], 0))
    toks = [ref[0]]
    while len(toks) < 6:
        assert time.monotonic() < deadline
        for x in d.collect(0.05).deltas:
            toks.extend(x.token_ids)
    assert toks == ref
    assert d.engine.recomputed == 0  # type: ignore[attr-defined]
    assert p.wait_idle(5.0) and d.wait_idle(5.0)
    assert not p.run(Abort("ghost")) and not d.run(Abort("ghost"))
    assert not any(p.request_state().values()) and not any(d.request_state().values())


def test_emulated_workers_take_the_profiles_time() -> None:
    """``emulated:h100-llama3-8b``: prefill, decode steps and the KV hand-off take the times the
    latency model predicts for an H100, while scheduling and transfers run for real."""
    from pdserve.steptime.roofline import H100_LLAMA3_8B as prof

    eng = EngineConfig(model="tiny", compute="emulated:h100-llama3-8b")
    tcfg = TransportConfig(backend="shm")
    p = PrefillWorker(WorkerSpec("p0", WorkerRole.PREFILL, eng, tcfg, SECRET))
    d = DecodeWorker(WorkerSpec("d0", WorkerRole.DECODE, eng, tcfg, SECRET))
    try:
        assert d.info().max_model_len == prof.max_model_len
        assert d.info().kv_blocks == prof.kv_capacity_tokens // 16
        assert p.collect(0.01).load.busy_s == 0.0  # nothing computed yet
        prompt = tuple(range(20, 200)) * 20  # 3,600 tokens: beyond the tiny model's own context
        w = WorkItem("e", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
        t0 = time.perf_counter()
        target = reserve(d, w, "t-e", timeout_s=5)
        p.run(Prefill(w, target))
        times: list[float] = []
        first: TokenDelta | None = None
        while first is None:
            first = next((x for x in p.collect(0.05).deltas if x.prefilled), None)
        times.append(time.perf_counter())
        assert d.run(Start("e", first.token_ids[0], 0))
        while len(times) < 30:
            for x in d.collect(0.05).deltas:
                times.extend([time.perf_counter()] * len(x.token_ids))
        ttft = times[0] - t0
        # Prefill of 3,600 tokens in 512-token chunks (the default budget), plus overheads.
        chunks = [(min(512, 3600 - c), c) for c in range(0, 3600, 512)]
        predicted = sum(prof.step_time([ch]) for ch in chunks)
        assert predicted <= ttft <= predicted + 0.05, (ttft, predicted)
        # the worker's busy seconds are its steps' time: the planner reads its speed off them
        assert predicted <= p.collect(0.01).load.busy_s <= ttft, (ttft, predicted)
        gaps = sorted(b - a for a, b in itertools.pairwise(times))
        step = prof.decode_time(1, 3600)
        assert step * 0.95 <= gaps[len(gaps) // 2] <= step + 0.006, (gaps[len(gaps) // 2], step)
        # The first decode gap also carries the emulated hand-off of 3,600 tokens' KV.
        assert times[1] - times[0] >= prof.transfer_time(3600)
        assert 29 * step * 0.95 <= d.collect(0.01).load.busy_s <= times[-1] - times[0]
    finally:
        for w_ in (p, d):
            assert w_.wait_idle(5.0)
            w_.check_integrity()
            w_.shutdown()


def first_delta(p: PrefillWorker, rid: str, timeout_s: float = 10.0) -> list[TokenDelta]:
    """Every delta prefill reports for ``rid`` until the first one (and any with it)."""
    deadline = time.monotonic() + timeout_s
    got: list[TokenDelta] = []
    while not got:
        assert time.monotonic() < deadline, f"no delta for {rid}"
        got = [x for x in p.collect(0.05).deltas if x.request_id == rid]
    return got


def decode_tokens(d: DecodeWorker, rid: str, n: int, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    toks: list[int] = []
    while len(toks) < n:
        assert time.monotonic() < deadline, f"{rid}: {len(toks)} of {n} tokens"
        for x in d.collect(0.05).deltas:
            assert x.error is None, x.error
            if x.request_id == rid:
                toks.extend(x.token_ids)
    return toks


def serve_once(p: PrefillWorker, d: DecodeWorker, w: WorkItem, transfer_id: str) -> list[int]:
    """One request through the pair, as the router runs it; its tokens, once both are idle."""
    target = reserve(d, w, transfer_id, timeout_s=5)
    assert target is not None
    p.run(Prefill(w, target))
    (first,) = first_delta(p, w.request_id)
    assert first.prefilled and len(first.token_ids) == 1
    assert d.run(Start(w.request_id, first.token_ids[0], first.num_cached_tokens))
    tokens = [first.token_ids[0], *decode_tokens(d, w.request_id, w.params.max_tokens - 1)]
    assert p.wait_idle(5.0) and d.wait_idle(5.0)
    return tokens


def test_an_abort_after_the_hand_off_leaves_nothing_and_the_id_works_again(pair) -> None:
    """Prefill forgets a request once its KV is handed off, yet the router may still abort it
    there. That must not poison the id: the same id added again is served, not dropped."""
    p, d = pair
    pr = prompts(1, seed=31)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ref = OfflineDriver(ENGINE).generate([pr], params)[0].token_ids
    for attempt in range(2):
        assert serve_once(p, d, WorkItem("again", pr, params), f"t-again-{attempt}") == ref, attempt
        assert not p.run(Abort("again"))  # the router's late abort: prefill no longer has it
        assert not any(p.request_state().values())


def test_seeded_request_is_reproducible_under_a_reused_id(pair) -> None:
    """The same id and seed twice: the second run draws exactly the first one's tokens (no
    generator state survives a request), and nothing per request is left behind."""
    p, d = pair
    pr = prompts(1, seed=32)[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1234, ignore_eos=True)
    runs = []
    for attempt in range(2):
        runs.append(serve_once(p, d, WorkItem("seeded", pr, params), f"t-seeded-{attempt}"))
        # The router may abort on prefill after the hand-off (stop string, client gone).
        assert not p.run(Abort("seeded"))
    assert runs[0] == runs[1]
    assert runs[0] == OfflineDriver(ENGINE).generate([pr], params)[0].token_ids


def test_a_failed_push_after_the_first_token_is_recomputed_not_failed() -> None:
    """Decode's reservation expires while the prompt waits in prefill's queue: prefill's push
    is then rejected. The first token is already out, so the request must go on (decode
    recomputes), and prefill reports the lost KV, never an error."""
    tcfg = TransportConfig(backend="tcp", lease_s=0.2)
    p = PrefillWorker(WorkerSpec("p0", WorkerRole.PREFILL, ENGINE, tcfg, SECRET))
    d = DecodeWorker(WorkerSpec("d0", WorkerRole.DECODE, ENGINE, tcfg, SECRET))
    try:
        pr = prompts(1, seed=33)[0]
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        ref = OfflineDriver(ENGINE).generate([pr], params)[0].token_ids
        w = WorkItem("late-kv", pr, params)
        target = reserve(d, w, "t-late-kv", timeout_s=5)
        assert target is not None
        time.sleep(0.5)  # the lease runs out before prefill gets to it
        p.run(Prefill(w, target))
        deltas = first_delta(p, "late-kv")
        first = deltas[0]
        assert first.prefilled and first.token_ids == (ref[0],) and first.error is None
        assert d.run(Start("late-kv", ref[0], first.num_cached_tokens))
        assert [ref[0], *decode_tokens(d, "late-kv", 4)] == ref
        assert d.engine.recomputed == 1  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while not any(x.kv_lost for x in deltas):
            assert time.monotonic() < deadline, deltas
            deltas += [x for x in p.collect(0.05).deltas if x.request_id == "late-kv"]
        assert all(x.error is None for x in deltas), deltas
    finally:
        for w_ in (p, d):
            assert w_.wait_idle(5.0)
            w_.check_integrity()
            w_.shutdown()


def test_kv_lost_makes_decode_recompute_at_once(pair) -> None:
    """A prefill worker that died after the first token never sends the KV: told so, decode
    recomputes now instead of waiting out the 30 s lease."""
    _, d = pair
    pr = prompts(1, seed=34)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ref = OfflineDriver(ENGINE).generate([pr], params)[0].token_ids
    w = WorkItem("orphan", pr, params)
    assert reserve(d, w, "t-orphan", timeout_s=5) is not None
    t0 = time.monotonic()
    assert d.run(Start("orphan", ref[0], 0))  # the first token came from a prefill worker now dead
    assert d.run(KvLost("orphan"))
    assert [ref[0], *decode_tokens(d, "orphan", 3)] == ref
    assert time.monotonic() - t0 < 5.0
    assert d.engine.recomputed == 1  # type: ignore[attr-defined]


def test_aborts_are_not_starved_by_pending_reservations() -> None:
    """64 reservations wait for room on a full decode worker: an abort (and every other
    command) still goes through at once, and frees the blocks within a second."""
    small = dataclasses.replace(ENGINE, cache=CacheConfig(block_size=8, num_blocks=12))
    tcfg = TransportConfig(backend="tcp")
    d = DecodeWorker(WorkerSpec("d0", WorkerRole.DECODE, small, tcfg, SECRET))
    pool = ThreadPoolExecutor(80)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        hog = WorkItem("hog", tuple(range(1, 81)), params)  # 10 of 12 blocks
        assert reserve(d, hog, "t-hog", timeout_s=1) is not None
        waiting = [
            pool.submit(reserve, d, WorkItem(f"w{i}", tuple(range(1, 41)), params), f"t-w{i}", 30.0)
            for i in range(64)
        ]
        deadline = time.monotonic() + 10
        while d.load().waiting < 64:  # 64 pending (the hog's granted reservation runs)
            assert time.monotonic() < deadline, d.load()
            time.sleep(0.01)
        t0 = time.monotonic()
        assert d.run(Abort("hog"))
        took = time.monotonic() - t0
        assert took < 1.0, took
        # The blocks went to the first waiters, in order; aborting the rest resolves them.
        assert waiting[0].result(timeout=5) is not None
        assert waiting[1].result(timeout=5) is not None
        for i in [*range(2, 64), 0, 1]:  # the waiters first: freed blocks would go to them
            d.run(Abort(f"w{i}"))
        assert all(f.result(timeout=5) is None for f in waiting[2:])
        assert d.wait_idle(5.0)
        d.check_integrity()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        d.shutdown()


def test_pending_reservations_end_when_the_worker_stops() -> None:
    """A reservation waiting for room fails (WorkerFailed: the worker's fault, so the router
    moves the request) when its worker shuts down, instead of holding its caller until the
    deadline or saying "no room" (which would reach the client as RESOURCE_EXHAUSTED)."""
    small = dataclasses.replace(ENGINE, cache=CacheConfig(block_size=8, num_blocks=12))
    d = DecodeWorker(WorkerSpec("d0", WorkerRole.DECODE, small, TransportConfig(backend="tcp"), SECRET))
    pool = ThreadPoolExecutor(2)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert reserve(d, WorkItem("hog", tuple(range(1, 81)), params), "t-hog", timeout_s=1) is not None
        waiting = pool.submit(reserve, d, WorkItem("w", tuple(range(1, 41)), params), "t-w", 30.0)
        deadline = time.monotonic() + 5
        while d.request_state()["pending_reservations"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        d.shutdown()
        with pytest.raises(WorkerFailed):  # well before its 30 s deadline
            waiting.result(timeout=10)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def test_an_id_still_releasing_its_blocks_is_refused_then_works(pair) -> None:
    """Right after an abort, an aborted reservation's blocks may still wait under its id for the
    transport: the same id is refused until they are back, never given blocks that the pending
    release would then free under it."""
    _, d = pair
    pr = prompts(1, seed=35)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert reserve(d, WorkItem("x", pr, params), "t-x1", timeout_s=5) is not None
    assert d.run(Abort("x"))
    try:
        second = reserve(d, WorkItem("x", pr, params), "t-x2", timeout_s=5)
    except ValueError:
        assert d.wait_idle(5.0)
        second = reserve(d, WorkItem("x", pr, params), "t-x2", timeout_s=5)
    assert second is not None
    time.sleep(0.1)  # the old transfer's release, if any, has been polled by now
    assert d.request_state()["kv_tables"] == 1 and d.request_state()["reserved"] == 1
    assert d.run(Abort("x"))
