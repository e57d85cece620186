"""A worker's per-owner accounting of the requests it holds (``pdserve.worker.owners``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.worker.commands import Abort, AddLocal, Prefill, QueueReservation, Start, Withdraw
from pdserve.worker.messages import PlacedWork, TokenDelta, WorkItem
from pdserve.worker.owners import Owners


def work(rid: str, prompt: int = 100, max_tokens: int = 50, sent: int = 0) -> WorkItem:
    params = SamplingParams(max_tokens=max_tokens)
    return WorkItem(rid, tuple(range(prompt)), params, output_token_ids=(7,) * sent)


def test_a_remote_request_on_its_prefill_and_decode_workers() -> None:
    prefill, decode = Owners(), Owners()
    w = work("r", prompt=100, max_tokens=50)
    prefill.introduce(2, Prefill(w))
    decode.introduce(2, QueueReservation(w, "kv-r", 5.0))
    assert prefill.placed(2) == PlacedWork(prefills=1, prefill_tokens=100)
    assert prefill.others(0) == prefill.placed(2) and prefill.others(2) == PlacedWork()
    assert decode.placed(2) == PlacedWork(decodes=1, decode_context=125, decode_remaining=50)
    # the first token: the prompt is handed off, nothing of it is left on the prefill worker (a
    # kv_lost after it has no owner here: the channel sends it to every router)
    assert prefill.on_delta(TokenDelta("r", (9,), prefilled=True)) == 2
    assert prefill.placed(2) == PlacedWork() and len(prefill) == 0
    assert prefill.on_delta(TokenDelta("r", (), kv_lost=True)) is None
    decode.command(Start("r", 9, 0))
    assert decode.placed(2).decode_remaining == 49
    # decode: each token lowers what is left; the last ends it
    assert decode.on_delta(TokenDelta("r", (9, 9, 9))) == 2
    assert decode.placed(2).decode_remaining == 46
    assert decode.on_delta(TokenDelta("r", (9,), finished=True, finish_reason="stop")) == 2
    assert len(decode) == 0 and decode.total() == PlacedWork() and decode.owned_by(2) == []


def test_a_local_prefill_ends_with_its_first_token_and_carried_tokens_count() -> None:
    o = Owners()
    o.introduce(1, AddLocal(work("m", prompt=60, max_tokens=40, sent=10)))  # moved: 10 tokens sent
    # prompt + the sent tokens to (re)compute; half of the 30 still to come on top of them
    assert o.placed(1) == PlacedWork(1, 70, 1, 70 + 15, 30)
    o.on_delta(TokenDelta("m", ()))  # a step that sampled nothing for it: still prefilling
    assert o.placed(1).prefills == 1
    o.on_delta(TokenDelta("m", (9,)))
    assert o.placed(1) == PlacedWork(0, 0, 1, 85, 29)


def test_abort_withdraw_and_a_refused_id() -> None:
    o = Owners()
    o.introduce(0, Prefill(work("a")))
    o.introduce(1, Prefill(work("b")))
    with pytest.raises(ValueError, match="already"):
        o.introduce(1, Prefill(work("a")))  # the request here keeps its owner
    assert o.owner_of("a") == 0 and o.owned_by(1) == ["b"]
    o.command(Withdraw("a"), answer=False)  # it had started: still here
    assert o.owner_of("a") == 0
    o.command(Withdraw("a"), answer=True)
    o.command(Abort("b"), answer=True)
    o.command(Abort("zzz"), answer=False)  # not here: nothing happens
    assert len(o) == 0 and o.total() == PlacedWork()
    assert o.on_delta(TokenDelta("b", (1,))) is None  # a late delta of an aborted request


def test_handed_off_prompts_leave_nothing_behind() -> None:
    o = Owners()
    for i in range(5):
        o.introduce(i % 2, Prefill(work(f"r{i}")))
        assert o.on_delta(TokenDelta(f"r{i}", (1,), prefilled=True)) == i % 2
    assert len(o) == 0 and o.owned_by(0) == [] and o.total() == PlacedWork()


# -- the running totals against a reference recomputed from each request's history -------------


@dataclass
class Ref:
    owner: int
    kind: str  # "prefill" | "reserve" | "local"
    prompt: int
    sent: int
    max_tokens: int
    first_out: bool = False
    generated: int = 0  # tokens this worker reported, and Start's

    def work(self) -> PlacedWork:
        ctx = self.prompt + self.sent
        prefill = self.kind != "reserve" and not self.first_out
        decode = self.kind != "prefill"
        left = max(0, self.max_tokens - self.sent - self.generated)
        return PlacedWork(
            int(prefill),
            ctx if prefill else 0,
            int(decode),
            ctx + (self.max_tokens - self.sent) // 2 if decode else 0,
            left if decode else 0,
        )


def add(a: PlacedWork, b: PlacedWork) -> PlacedWork:
    return PlacedWork(*(x + y for x, y in zip(vars(a).values(), vars(b).values(), strict=True)))


OWNERS = 4
op = st.one_of(
    st.tuples(
        st.just("introduce"),
        st.integers(0, OWNERS - 1),
        st.sampled_from(["prefill", "reserve", "local"]),
        st.integers(1, 3000),
        st.integers(0, 20),
        st.integers(1, 500),
    ),
    st.tuples(st.just("tokens"), st.integers(0, 30), st.integers(0, 4), st.booleans()),
    st.tuples(st.just("finished"), st.integers(0, 30)),
    st.tuples(st.just("kv_lost"), st.integers(0, 30)),
    st.tuples(st.just("start"), st.integers(0, 30)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("withdraw"), st.integers(0, 30), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=80))
def test_totals_are_the_sum_over_live_requests_and_nothing_is_left(ops: list[tuple[Any, ...]]) -> None:
    o = Owners()
    ref: dict[str, Ref] = {}
    n = 0
    for step in ops:
        kind, *rest = step
        if kind == "introduce":
            owner, what, prompt, sent, extra = rest
            rid, n = f"r{n}", n + 1
            w = work(rid, prompt, sent + extra, sent if what == "local" else 0)
            cmd = {"prefill": Prefill(w), "reserve": QueueReservation(w, "kv", 1.0), "local": AddLocal(w)}[
                what
            ]
            o.introduce(owner, cmd)
            ref[rid] = Ref(owner, what, prompt, len(w.output_token_ids), w.params.max_tokens)
            continue
        rid = f"r{rest[0]}"
        r = ref.get(rid)
        if kind == "tokens":
            count, prefilled = rest[1], rest[2]
            got = o.on_delta(TokenDelta(rid, (5,) * count, prefilled=prefilled))
            if r is not None:
                if r.kind != "reserve" and (prefilled or count):
                    r.first_out = True
                r.generated += count if r.kind != "prefill" else 0
                if r.kind == "prefill" and r.first_out:
                    del ref[rid]  # handed off: forgotten here
        elif kind in ("finished", "kv_lost"):
            got = o.on_delta(TokenDelta(rid, (), finished=kind == "finished", kv_lost=kind == "kv_lost"))
            ref.pop(rid, None)
        elif kind == "start":
            o.command(Start(rid, 5, 0))
            got = None if r is None else r.owner
            if r is not None and r.kind != "prefill":
                r.generated += 1
        elif kind == "abort" or (kind == "withdraw" and rest[1]):
            o.command(Abort(rid) if kind == "abort" else Withdraw(rid), True)
            got = None if r is None else r.owner
            ref.pop(rid, None)
        else:
            o.command(Withdraw(rid), False)
            got = None if r is None else r.owner
        assert got == (None if r is None else r.owner)
        for owner in range(OWNERS):
            mine = PlacedWork()
            theirs = PlacedWork()
            for x in ref.values():
                if x.owner == owner:
                    mine = add(mine, x.work())
                else:
                    theirs = add(theirs, x.work())
            assert o.placed(owner) == mine
            assert o.others(owner) == theirs
            assert sorted(o.owned_by(owner)) == sorted(k for k, x in ref.items() if x.owner == owner)
    for rid in list(ref):  # every request ends: nothing is left
        o.on_delta(TokenDelta(rid, (), finished=True))
    assert len(o) == 0 and o.total() == PlacedWork()
    assert all(o.owned_by(owner) == [] for owner in range(OWNERS))
