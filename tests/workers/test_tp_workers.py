"""Prefill and decode workers of every pair of TP degrees in {1, 2, 4}, in one process (their
other ranks are child processes): Hugging Face's greedy tokens through real re-sharded KV
transfers, each decode rank receiving exactly its own heads' bytes, in a bounded number of
copies, and nothing left behind on any rank."""

from __future__ import annotations

import itertools
import math
import random
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pdserve.decode_worker.actor import DecodeWorker
from pdserve.kvtransfer.config import TransportConfig
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.parallel.reshard import routes_to
from pdserve.model_runtime.parallel.sharding import kv_heads_of
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.prefill_worker.actor import PrefillWorker
from pdserve.worker.commands import AwaitReservation, Prefill, QueueReservation, Start
from pdserve.worker.messages import KVTarget, WorkerRole, WorkItem
from pdserve.worker.spec import WorkerSpec
from tests.engine.hf_models import VOCAB, hf_greedy, make_hf_model

SECRET = b"tp-worker-test-secret-0123"
DEGREES = (1, 2, 4)
KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 4, 8, 2, 8
GEN = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[int, ...]], list[list[int]]]:
    d = tmp_path_factory.mktemp("tp-llama")
    hf = make_hf_model("llama", d, seed=11, num_attention_heads=8, num_key_value_heads=KV_HEADS)
    rng = random.Random(5)
    prompts = [tuple(rng.randrange(3, VOCAB) for _ in range(n)) for n in (5, 17, 33)]
    return d, prompts, [hf_greedy(hf, list(p), GEN)[0] for p in prompts]


def _engine(path: Path, tp: int) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        device="cpu",
        backend="torch",
        tp=tp,
        cache=CacheConfig(block_size=BLOCK, num_blocks=48),
        scheduler=SchedulerConfig(64, 8),
    )


@pytest.fixture(scope="module")
def workers(model: Any) -> Any:
    path = model[0]
    made: list[Any] = []
    try:
        prefill = {}
        decode = {}
        for tp in DEGREES:
            # shm between most pairs, tcp into TP 2 decode: both data paths carry head slices
            backend = "tcp" if tp == 2 else "auto"
            prefill[tp] = PrefillWorker(
                WorkerSpec(
                    f"p{tp}", WorkerRole.PREFILL, _engine(path, tp), TransportConfig(backend="auto"), SECRET
                )
            )
            made.append(prefill[tp])
            decode[tp] = DecodeWorker(
                WorkerSpec(
                    f"d{tp}", WorkerRole.DECODE, _engine(path, tp), TransportConfig(backend=backend), SECRET
                )
            )
            made.append(decode[tp])
        yield prefill, decode
    finally:
        for w in made:
            w.shutdown()


def _counters(w: Any) -> list[tuple[int, int, int, int]]:
    """Each rank's (bytes sent, bytes received, copies sent, copies received)."""
    t = w.transport
    t.num_records()  # a fresh word from every rank
    s = t.own.stats
    own = (s.bytes_sent, s.bytes_received, s.descriptors_sent, s.descriptors_received)
    return [own] + [
        (a.bytes_sent, a.bytes_received, a.descriptors_sent, a.descriptors_received) for a in t.rank_counters
    ]


def _run(p: PrefillWorker, d: DecodeWorker, prompts: list[tuple[int, ...]]) -> dict[str, list[int]]:
    """A minimal router: reserve (naming the prefill worker's ranks), prefill, start on the
    first token, collect until finished."""
    params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    items = [WorkItem(f"r{i}-{uuid.uuid4().hex[:6]}", pr, params) for i, pr in enumerate(prompts)]
    out: dict[str, list[int]] = {w.request_id: [] for w in items}
    for w in items:
        tid = f"t-{uuid.uuid4().hex}"
        assert d.run(QueueReservation(w, tid, 10.0, p.info().kv_ranks))
        target = d.run(AwaitReservation(w.request_id), 40.0)
        assert isinstance(target, KVTarget)
        assert len(target.ranks) == (d.info().kv_ranks if d.info().kv_ranks > 1 else 0)
        p.run(Prefill(w, target))
    done: set[str] = set()
    deadline = time.monotonic() + 60
    while len(done) < len(items):
        assert time.monotonic() < deadline, f"unfinished: {set(out) - done}"
        for worker in (p, d):
            for delta in worker.collect(0.01).deltas:
                assert delta.error is None and not delta.kv_lost, delta
                out[delta.request_id].extend(delta.token_ids)
                if delta.prefilled:
                    assert d.run(Start(delta.request_id, delta.token_ids[0], delta.num_cached_tokens))
                if delta.finished:
                    done.add(delta.request_id)
    return {rid: out[rid] for rid in (w.request_id for w in items)}


@pytest.mark.parametrize(("ptp", "dtp"), list(itertools.product(DEGREES, DEGREES)))
def test_every_pair_of_degrees_decodes_the_reference_tokens(
    model: Any, workers: Any, ptp: int, dtp: int
) -> None:
    _, prompts, expected = model
    prefill, decode = workers
    p, d = prefill[ptp], decode[dtp]
    before, sent_before = _counters(d), _counters(p)
    got = _run(p, d, prompts)
    assert list(got.values()) == expected
    for w in (p, d):
        assert w.wait_idle(5.0)
        w.check_integrity()  # blocks, requests and every rank's transfer records
    after, sent_after = _counters(d), _counters(p)
    per_prompt = [math.ceil(len(pr) / BLOCK) for pr in prompts]
    blocks = sum(per_prompt)
    fewest = most = 0
    for rank in range(dtp):
        heads = kv_heads_of(KV_HEADS, dtp, rank)[1]
        want = blocks * LAYERS * 2 * BLOCK * heads * HEAD_DIM * 4  # float32
        got_bytes = after[rank][1] - before[rank][1]
        assert got_bytes == want, f"decode rank {rank} of {dtp}: {got_bytes} bytes, its heads are {want}"
        # Copies a sliced transfer makes into this rank: one per layer (K and V together) and
        # run of blocks, per prefill rank that holds some of its heads — within the bound of
        # layers x 2 x max/min degree per run; whole blocks need no slicing.
        parts = len(routes_to(KV_HEADS, ptp, dtp, rank))
        per_run = 0 if ptp == dtp else parts * LAYERS
        assert per_run <= LAYERS * 2 * max(ptp, dtp) // min(ptp, dtp)
        fewest += per_run * len(prompts)  # each prompt's blocks one run
        most += per_run * blocks  # every block its own run: still per block, never per token slot
    # Every rank's copies, counted where they are made: a sliced route copies on at least one
    # side (on shm the sender writes; on tcp the side whose cache holds more heads than the
    # slice packs or scatters), at most on both.
    copies = sum(a[2] - b[2] for a, b in zip(sent_after, sent_before, strict=True))
    copies += sum(a[3] - b[3] for a, b in zip(after, before, strict=True))
    assert fewest <= copies <= 2 * most, f"{copies} copies, expected {fewest}..{2 * most}"
    # No prefill rank sent more than its own heads' share: the bytes leave every rank directly.
    sent = [a[0] - b[0] for a, b in zip(sent_after, sent_before, strict=True)]
    assert sum(sent) == sum(after[r][1] - before[r][1] for r in range(dtp))


def test_an_idle_worker_whose_rank_exits_fails_at_once(model: Any) -> None:
    """No step needs to run into the dead rank: the worker's loop fails as soon as the rank's
    process ends, so its channel closes and the router replaces it before a request meets it."""
    import os
    import signal

    from pdserve.model_runtime.parallel.group import RankLost
    from pdserve.worker.loop import WorkerFailed

    d = DecodeWorker(WorkerSpec("dx", WorkerRole.DECODE, _engine(model[0], 2), TransportConfig(), SECRET))
    try:
        setup = d.rt.ranks
        assert setup is not None and setup.ranks is not None
        os.kill(setup.ranks.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while d.loop.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert isinstance(d.loop.error, RankLost)
        with pytest.raises(WorkerFailed):
            d.collect(0.01)
    finally:
        d.shutdown()


@pytest.mark.parametrize(("ptp", "dtp"), [(2, 4), (4, 1)])
def test_aborts_racing_re_sharded_hand_offs_leave_no_part_on_any_rank(
    model: Any, workers: Any, ptp: int, dtp: int
) -> None:
    """Requests aborted on both sides at every point of their hand-off — queued, reserved,
    prefilled while parts fly — end with every block and every part's record gone on every
    rank of both workers."""
    from pdserve.worker.commands import Abort

    _, prompts, _ = model
    prefill, decode = workers
    p, d = prefill[ptp], decode[dtp]
    params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    rng = random.Random(ptp * 10 + dtp)
    for i in range(12):
        w = WorkItem(f"a{i}-{uuid.uuid4().hex[:6]}", prompts[i % len(prompts)] * (1 + i % 3), params)
        tid = f"t-{uuid.uuid4().hex}"
        assert d.run(QueueReservation(w, tid, 10.0, p.info().kv_ranks))
        point = rng.randrange(3)
        if point >= 1:
            target = d.run(AwaitReservation(w.request_id), 40.0)
            assert isinstance(target, KVTarget)
            if point == 2:
                p.run(Prefill(w, target))
                time.sleep(rng.random() * 0.01)
        d.run(Abort(w.request_id))
        p.run(Abort(w.request_id))
    for w in (p, d):
        assert w.wait_idle(10.0)
        deadline = time.monotonic() + 10
        while True:  # the parts' last outcomes come in on the next polls
            try:
                w.check_integrity()
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def test_a_colocated_tp2_worker_decodes_the_reference_tokens(model: Any) -> None:
    from pdserve.worker.commands import AddLocal

    path, prompts, expected = model
    w = DecodeWorker(WorkerSpec("c2", WorkerRole.COLOCATED, _engine(path, 2), TransportConfig(), SECRET))
    try:
        params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
        got: dict[str, list[int]] = {}
        for i, pr in enumerate(prompts):
            w.run(AddLocal(WorkItem(f"c{i}", pr, params)))
            got[f"c{i}"] = []
        deadline = time.monotonic() + 30
        while sum(len(v) for v in got.values()) < GEN * len(prompts):
            assert time.monotonic() < deadline
            for delta in w.collect(0.01).deltas:
                got[delta.request_id].extend(delta.token_ids)
        assert list(got.values()) == expected
        assert w.wait_idle(5.0)
        w.check_integrity()
    finally:
        w.shutdown()
