"""Overlapped decode steps (pure: a deterministic fake runner, no torch).

The engine plans and launches step N+1 before it reads step N's tokens. Whatever the order of
adds, aborts, re-used ids, stop tokens and a pool that runs dry, it must produce exactly the
tokens and finish reasons of the synchronous engine, and no step may write a block that is back
in the pool (or another request's) before that step's tokens are read.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.model_runtime.engine.runner import StepResult
from pdserve.model_runtime.kv_cache.manager import KVCacheManager, check_idle
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.colocated import ColocatedScheduler
from pdserve.model_runtime.scheduler.plan import PENDING_TOKEN, ScheduledChunk, SchedulerConfig
from pdserve.model_runtime.validation import RequestLimits
from pdserve.worker.messages import TokenDelta, WorkerRole, WorkItem

VOCAB = 97
EOS = 0
BS = 4


class Step:
    """A launched fake step: computed at launch, its writes checked when its result is read."""

    def __init__(self, runner: FakeRunner, chunks: Sequence[ScheduledChunk], sampled: dict[str, int]) -> None:
        self.runner, self.sampled = runner, sampled
        self.writes = [(c.request_id, c.block_table[p // BS]) for c in chunks for p in _positions(c)]

    def result(self) -> StepResult:
        kv = self.runner.kv
        for rid, block in self.writes:
            assert kv.pool.ref_count(block) > 0, f"a launched step wrote block {block}, back in the pool"
            for other, table in kv._blocks.items():
                assert other == rid or block not in table, f"block {block} of {rid} now belongs to {other}"
        return StepResult(self.sampled, {})


def _positions(c: ScheduledChunk) -> range:
    return range(c.start_pos, c.start_pos + c.num_tokens)


@dataclass
class FakeRunner:
    """Tokens are a function of the previous token and the position (EOS now and then), so the
    synchronous and the overlapped engine must agree token for token."""

    kv: KVCacheManager
    eos_every: int = 7
    previous: dict[str, int] = field(default_factory=dict)
    pending_rows: int = 0

    def token_for(self, prev: int, pos: int) -> int:
        t = ((prev + 1) * 2654435761 + pos * 40503) % 1_000_003 % VOCAB
        return EOS if t % self.eos_every == 0 else t

    def _sample(self, chunks: Sequence[ScheduledChunk]) -> dict[str, int]:
        previous, self.previous = self.previous, {}
        out = {}
        for c in chunks:
            if c.pending:
                assert c.token_ids == (PENDING_TOKEN,)
                self.pending_rows += 1
            if c.sample:
                last = previous[c.request_id] if c.pending else c.token_ids[-1]
                out[c.request_id] = self.token_for(last, c.start_pos + c.num_tokens)
        self.previous = out
        return out

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> Step:
        return Step(self, chunks, self._sample(chunks))

    def execute(self, chunks, requests, on_layer=None):  # type: ignore[no-untyped-def]
        return self.launch(chunks, requests).result()

    def release(self, request_id: str) -> None:
        pass

    def kept_requests(self) -> int:
        return 0


@dataclass
class FakeRuntime:
    kv: KVCacheManager
    runner: FakeRunner
    block_size: int = BS
    eos_ids: frozenset[int] = frozenset({EOS})
    grammars: None = None  # no structured output

    def limits(self, max_prompt_tokens: int = 0, max_tokens_cap: int = 0) -> RequestLimits:
        return RequestLimits(VOCAB, 512, BS, self.kv.num_blocks, 0, False)


def engine(overlap: bool, num_blocks: int = 64, eos_every: int = 7, max_seqs: int = 8) -> DecodeEngine:
    kv = KVCacheManager(num_blocks, BS, True)
    rt = FakeRuntime(kv, FakeRunner(kv, eos_every))
    return DecodeEngine(rt, None, SchedulerConfig(32, max_seqs), "w", WorkerRole.COLOCATED, overlap=overlap)


def item(rid: str, prompt_len: int, max_tokens: int, ignore_eos: bool = False, seed: int = 0) -> WorkItem:
    prompt = tuple((seed * 7 + i * 3) % (VOCAB - 1) + 1 for i in range(prompt_len))
    return WorkItem(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None


def run(
    eng: DecodeEngine,
    adds: Sequence[tuple[int, WorkItem]],
    aborts: Sequence[tuple[int, str]] = (),
    max_steps: int = 2000,
    chaos: tuple[random.Random, float] | None = None,
) -> dict[str, Outcome]:
    """Step until idle; ``adds``/``aborts``: (step index, what) applied before that step;
    ``chaos`` (rng, p): before each step, with probability p, abort a request the engine holds,
    whatever its state. The outcome of an id aborted, or re-added while still on the worker
    (refused), is dropped: where either lands differs between the engines. A re-used id's
    outcome is its last request's."""
    out: dict[str, Outcome] = {}
    aborted: set[str] = set()
    for i in range(max_steps):
        if chaos is not None and eng._requests and chaos[0].random() < chaos[1]:
            victim = chaos[0].choice(sorted(eng._requests))
            assert eng.abort(victim)
            aborted.add(victim)
        for at, w in adds:
            if at == i:
                try:
                    eng.add_local(w)
                except ValueError:
                    aborted.add(w.request_id)
                    continue
                out[w.request_id] = Outcome()
        for at, rid in aborts:
            if at == i and eng.abort(rid):
                aborted.add(rid)
        for d in eng.step():
            collect(out[d.request_id], d)
        if i > max((a for a, _ in [*adds, *aborts]), default=0) and not eng.has_work:
            break
    else:
        raise AssertionError("the engine did not finish")
    assert eng.idle
    check_idle(eng.kv, True, eng.request_state())
    return {rid: o for rid, o in out.items() if rid not in aborted}


def collect(o: Outcome, d: TokenDelta) -> None:
    assert o.finish is None, "a delta after the last one"
    o.tokens.extend(d.token_ids)
    if d.finished:
        o.finish = d.finish_reason


def test_overlap_gives_the_synchronous_tokens_and_launches_ahead() -> None:
    adds = [(0, item(f"r{i}", 3 + 5 * i, 10 + 7 * i, seed=i)) for i in range(6)]
    sync, ovl = engine(False, eos_every=23), engine(True, eos_every=23)
    expect = run(sync, adds)
    assert run(ovl, adds) == expect
    assert {o.finish for o in expect.values()} == {"stop", "length"}
    assert sync.rt.runner.pending_rows == 0
    assert ovl.rt.runner.pending_rows > 20  # decode stretches really ran ahead


def test_a_request_ending_on_a_stop_token_keeps_its_blocks_until_the_step_ahead_is_read() -> None:
    eng = engine(True, eos_every=1_000_000)  # no EOS by the token function: we place one
    eng.add_local(item("a", 5, 50))
    deltas: list[TokenDelta] = []
    while len(deltas) < 3:  # prefill, then two decode steps read
        deltas += eng.step()
    req = eng._requests["a"]
    held = len(eng.kv.block_table("a"))
    eng.rt.runner.eos_every = 1  # every token is EOS: the step in flight ends it
    fin = []
    while not fin:
        fin = [d for d in eng.step() if d.finished]
    assert fin[0].finish_reason == "stop" and req.is_finished
    assert not eng.kv.holds("a")  # the id is free for a new request at once ...
    assert eng.kv.request_state()["kv_retired"] == 1  # ... its blocks wait for the step ahead
    assert eng.kv.stats().used >= held
    assert eng.has_work and not eng.idle
    assert eng.step() == []  # the step ahead's token for "a" is dropped
    assert eng.idle and eng.kv.stats().used == 0


def test_max_tokens_is_known_ahead_and_costs_no_extra_row() -> None:
    eng = engine(True, eos_every=1_000_000)
    out = run(eng, [(0, item("a", 9, 6))])
    assert len(out["a"].tokens) == 6 and out["a"].finish == "length"
    # 6 tokens: the prefill's, then 5 decode rows, 4 of them ahead (the first follows the prefill
    # step, which is planned after it); the last token's step plans none.
    assert eng.rt.runner.pending_rows == 4


def test_an_abort_while_a_step_is_in_flight_and_a_reused_id() -> None:
    eng = engine(True, eos_every=1_000_000)
    eng.add_local(item("x", 6, 40))
    for _ in range(4):
        eng.step()
    assert eng._launched is not None
    assert eng.abort("x")
    assert eng.kv.request_state()["kv_retired"] == 1
    eng.add_local(item("x", 4, 3, seed=5))  # the same id, a different request, at once
    out = Outcome()
    while eng.has_work:
        for d in eng.step():
            assert d.request_id == "x"
            collect(out, d)
    assert len(out.tokens) == 3 and out.finish == "length"
    alone = run(engine(False, eos_every=1_000_000), [(0, item("x", 4, 3, seed=5))])
    assert out == alone["x"]  # no token of the aborted request reached the new one
    check_idle(eng.kv, True, eng.request_state())


def test_a_pool_too_small_to_plan_ahead_falls_back_to_preempting_in_step() -> None:
    adds = [(0, item(f"r{i}", 7, 30, ignore_eos=True, seed=i)) for i in range(4)]
    sync, ovl = engine(False, num_blocks=14), engine(True, num_blocks=14)
    expect = run(sync, adds)
    assert run(ovl, adds) == expect
    assert all(len(o.tokens) == 30 for o in expect.values())
    assert ovl.scheduler.num_preemptions > 0


def test_schedule_ahead_changes_nothing_when_it_cannot_plan() -> None:
    kv = KVCacheManager(3, BS, True)
    sched = ColocatedScheduler(kv, SchedulerConfig(32, 8))
    req = Request("a", (1, 2, 3), SamplingParams(max_tokens=20))
    sched.add_request(req)
    plan = sched.schedule()
    sched.update(plan, {"a": 9})
    plan = sched.schedule()  # decode row at position 3: the first block is full after it
    free = kv.num_free_blocks
    ahead = sched.schedule_ahead()
    assert ahead is not None and ahead.chunks[0].pending and ahead.chunks[0].start_pos == 4
    assert kv.num_free_blocks == free - 1  # room for position 4 (the pending input's slot)
    with pytest.raises(RuntimeError):
        sched.schedule_ahead()  # one plan ahead at most
    with pytest.raises(RuntimeError):
        sched.schedule()  # nor a plan beside one in flight
    sched.update(plan, {"a": 11})
    sched.update(ahead, {"a": 12})
    assert req.output_token_ids == [9, 11, 12]
    kv2 = KVCacheManager(1, BS, True)  # a pool that cannot take the row ahead
    s2 = ColocatedScheduler(kv2, SchedulerConfig(32, 8))
    s2.add_request(Request("b", (1, 2), SamplingParams(max_tokens=20)))
    s2.update(s2.schedule(), {"b": 3})
    s2.schedule()  # position 2: the block's third slot
    assert s2.schedule_ahead() is not None  # position 3 still fits the block
    kv3 = KVCacheManager(1, BS, True)
    s3 = ColocatedScheduler(kv3, SchedulerConfig(32, 8))
    s3.add_request(Request("c", (1, 2, 3), SamplingParams(max_tokens=20)))
    s3.update(s3.schedule(), {"c": 3})
    s3.schedule()  # position 3, the block's last slot
    state = (kv3.num_free_blocks, kv3.request_state())
    assert s3.schedule_ahead() is None
    assert (kv3.num_free_blocks, kv3.request_state()) == state


@pytest.mark.parametrize("case", ["chunked", "prefix-hit"])
def test_a_prompts_last_single_token_chunk_is_read_before_an_abort(case: str) -> None:
    """A prompt's last chunk of one token looks like a decode row, but its blocks belong to the
    prefill side, which frees them on an abort at once: its step must not stay in flight."""
    eng = engine(True, eos_every=1_000_000)
    if case == "chunked":  # a 32-token budget: 32 tokens, then the 33rd alone
        eng.add_local(item("a", 33, 5, ignore_eos=True))
        eng.step()
    else:  # the same 9-token prompt again: 8 tokens hit the cache, the 9th runs alone
        run(eng, [(0, item("x", 9, 3, ignore_eos=True))])
        eng.add_local(item("a", 9, 3, ignore_eos=True))
    eng.step()  # the single-token chunk's step: read before the engine returns
    assert eng._launched is None
    assert eng.abort("a")
    while eng.has_work:
        eng.step()  # the fake runner checks each step's blocks when it is read
    check_idle(eng.kv, True, eng.request_state())


actions = st.lists(
    st.tuples(
        st.integers(0, 30),  # step
        st.sampled_from(["add", "add", "abort"]),
        st.integers(0, 5),  # id
        st.integers(1, 40),  # prompt length (over the 32-token budget: chunked)
        st.integers(1, 24),  # max tokens
    ),
    min_size=2,
    max_size=14,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions,
    st.integers(10, 40),
    st.integers(2, 9),
    st.integers(1, 4),
    st.integers(0, 2**32),
    st.sampled_from([0, 0.3]),
)
def test_overlap_matches_the_synchronous_engine(acts, num_blocks, eos_every, max_seqs, seed, chaos) -> None:  # type: ignore[no-untyped-def]
    adds: list[tuple[int, WorkItem]] = []
    aborts: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    for at, kind, n, plen, mt in sorted(acts, key=lambda a: a[0]):
        rid = f"q{n}"
        if kind == "add":
            if seen.get(rid, -1) >= at:
                continue  # one add per id and step
            seen[rid] = at
            # every request fits the pool alone (admission guarantees it in service)
            cap = (num_blocks - 1) * BS // 2
            plen, mt = min(plen, cap), min(mt, cap)
            adds.append((at, item(rid, plen, mt, seed=n % 2)))  # shared prefixes: cache hits
        else:
            aborts.append((at, rid))
    reused = {rid for rid in seen if sum(w.request_id == rid for _, w in adds) > 1}
    # chaos: before each step, abort a held request with this probability, whatever its state
    sync = run(
        engine(False, num_blocks, eos_every, max_seqs), adds, aborts, chaos=(random.Random(seed), chaos)
    )
    ovl = run(engine(True, num_blocks, eos_every, max_seqs), adds, aborts, chaos=(random.Random(seed), chaos))
    for rid in (sync.keys() & ovl.keys()) - reused:
        assert sync[rid] == ovl[rid], rid
    if not chaos:
        once = {w.request_id for _, w in adds} - reused - {rid for _, rid in aborts}
        assert once <= sync.keys() and once <= ovl.keys()
