"""A collect's deltas, each request's consecutive tokens joined into one (``worker.deltas``)."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.worker.deltas import coalesce
from pdserve.worker.loop import EngineLoop
from pdserve.worker.messages import Logprob, TokenDelta, WorkerLoad, WorkerRole


def lp(t: int) -> Logprob:
    return Logprob(t, -0.25 * t, ((t, -0.25 * t), (t + 1, -9.0)))


def test_steps_of_several_requests_become_one_delta_each() -> None:
    steps = [
        [TokenDelta("a", (1,), (lp(1),)), TokenDelta("b", (11,), (lp(11),), num_cached_tokens=3)],
        [TokenDelta("a", (2,), (lp(2),)), TokenDelta("b", (12,), (lp(12),), num_cached_tokens=3)],
        [TokenDelta("a", (3,), (lp(3),), finished=True, finish_reason="stop", stop_token_id=3),
         TokenDelta("b", (13,), (lp(13),), num_cached_tokens=3)],
    ]  # fmt: skip
    assert coalesce([d for step in steps for d in step]) == [
        TokenDelta("a", (1, 2, 3), (lp(1), lp(2), lp(3)), True, "stop", 3),
        TokenDelta("b", (11, 12, 13), (lp(11), lp(12), lp(13)), num_cached_tokens=3),
    ]


def test_deltas_that_say_more_than_tokens_are_kept_and_end_a_run() -> None:
    first = TokenDelta("a", (1,), prefilled=True)
    lost = TokenDelta("a", (), kv_lost=True)
    failed = TokenDelta("b", (), finished=True, finish_reason="error", error="boom")
    deltas = [
        first, TokenDelta("a", (2,)), TokenDelta("b", (5,)), TokenDelta("a", (3,)), lost,
        TokenDelta("a", (4,)), failed, TokenDelta("a", (5,), finished=True, finish_reason="length"),
        TokenDelta("a", (6,)),  # after its end (a late one): not joined to it
    ]  # fmt: skip
    assert coalesce(deltas) == [
        first, TokenDelta("a", (2, 3)), TokenDelta("b", (5,)), lost,
        TokenDelta("a", (4, 5), finished=True, finish_reason="length"), failed, TokenDelta("a", (6,)),
    ]  # fmt: skip


KINDS = st.sampled_from(["plain", "plain", "plain", "finished", "prefilled", "kv_lost", "error"])


def make(rid: str, kind: str, t: int, with_lps: bool) -> TokenDelta:
    ids = (t,) if kind != "kv_lost" and kind != "error" else ()
    lps = tuple(lp(i) for i in ids) if with_lps else None
    return TokenDelta(
        rid,
        ids,
        lps,
        finished=kind in ("finished", "error"),
        finish_reason={"finished": "length", "error": "error"}.get(kind),
        num_cached_tokens=t % 3,
        prefilled=kind == "prefilled",
        error="gone" if kind == "error" else None,
        kv_lost=kind == "kv_lost",
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), KINDS, st.booleans()), max_size=40))
def test_each_request_sees_the_same_tokens_flags_and_order(spec: list[tuple[str, str, bool]]) -> None:
    deltas = [make(rid, kind, t, lps) for t, (rid, kind, lps) in enumerate(spec)]
    out = coalesce(deltas)
    for rid in "abc":
        before = [d for d in deltas if d.request_id == rid]
        after = [d for d in out if d.request_id == rid]
        assert flat(after) == flat(before)
        # every delta that says more than tokens is kept as it was, in its place
        special = [d for d in before if d.prefilled or d.kv_lost or d.error is not None]
        assert [d for d in after if d.prefilled or d.kv_lost or d.error is not None] == special
        assert len(after) <= len(before)


def flat(ds: list[TokenDelta]) -> list[tuple[str, object]]:
    """A request's deltas as a sequence of events: each token with its logprob, then the
    delta's flags (what the router acts on, in order)."""
    out: list[tuple[str, object]] = []
    for d in ds:
        for i, t in enumerate(d.token_ids):
            out.append(("token", (t, d.logprobs[i] if d.logprobs is not None else None)))
        for flag in ("prefilled", "kv_lost", "error"):
            if getattr(d, flag):
                out.append((flag, getattr(d, flag)))
        if d.finished:
            out.append(("finished", (d.finish_reason, d.stop_token_id)))
    return out


class ThreeSteps:
    """A role engine that runs three steps of two requests when asked, one token each."""

    role = WorkerRole.DECODE

    def __init__(self) -> None:
        self.left = 0
        self.done = threading.Event()
        self.kv = KVCacheManager(num_blocks=8, block_size=4)  # (its loop logs the pool's events)

    @property
    def has_work(self) -> bool:
        return self.left > 0

    has_pending_io = False
    idle = True

    def go(self) -> None:
        self.left = 3

    def step(self) -> list[TokenDelta]:
        self.left -= 1
        n = 3 - self.left
        if not self.left:
            self.done.set()
        return [TokenDelta("a", (n,)), TokenDelta("b", (10 + n,))]

    def io_wait_s(self) -> float:
        return 0.0

    def abort(self, request_id: str) -> bool:
        return False

    def load(self, address: str = "") -> WorkerLoad:
        return WorkerLoad("w", self.role, address, 0, 0, 1, 1, 0)

    def check_integrity(self) -> None:
        pass

    def request_state(self) -> dict[str, int]:
        return {}

    def on_stop(self) -> None:
        pass


def test_a_collect_after_several_steps_joins_each_requests_tokens() -> None:
    engine = ThreeSteps()
    loop = EngineLoop(engine)
    try:
        loop.call(engine.go)
        assert engine.done.wait(5.0)
        assert loop.collect(1.0) == [TokenDelta("a", (1, 2, 3)), TokenDelta("b", (11, 12, 13))]
    finally:
        loop.stop()
