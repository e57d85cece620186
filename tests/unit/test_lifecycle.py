"""The request state machine (``pdserve.router.lifecycle``) on its own: hand-picked paths, and
any order of answers, failures, deltas, lost workers and the end (hypothesis), against the
invariants every driver relies on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.router.errors import Code
from pdserve.router.lifecycle import (
    Attempt,
    Deliver,
    Drop,
    Effect,
    Fail,
    Failure,
    Hold,
    Relocate,
    Send,
    Stage,
    Timeouts,
    failure_of,
    why_not_migrate,
)
from pdserve.worker import commands as C
from pdserve.worker.messages import KVTarget, TokenDelta, WorkItem

WORK = WorkItem("r1", (1, 2, 3), SamplingParams(max_tokens=4))
TARGET = KVTarget("kv-r1", "127.0.0.1:1", ("tcp",), (0,))
T = Timeouts(call_s=5.0, reserve_s=2.0)


def sends(effects: list[Effect]) -> list[tuple[str, type]]:
    return [(e.worker, type(e.command)) for e in effects if isinstance(e, Send)]


def answer(a: Attempt, effects: list[Effect], value: object) -> list[Effect]:
    (s,) = [e for e in effects if isinstance(e, Send)]
    return a.answered(s, value)


def test_a_remote_attempt_joins_its_two_tracks() -> None:
    a = Attempt(WORK, "d", "p", T)
    first = a.dispatch()
    assert sends(first) == [("p", C.Prefill), ("d", C.QueueReservation)]
    prefill, queue = (e for e in first if isinstance(e, Send))
    assert a.answered(prefill, None)[1:] == []  # no target yet: nothing to set
    waiting = a.answered(queue, True)
    assert sends(waiting) == [("d", C.AwaitReservation)]
    assert waiting[0].timeout_s == T.reserve_s + T.call_s  # type: ignore[union-attr]
    # the first token before the blocks: Start waits for them
    assert sends(a.on_delta("p", TokenDelta("r1", (7,), prefilled=True))) == []
    granted = answer(a, waiting, TARGET)
    assert sends(granted) == [("p", C.SetTarget), ("d", C.Start)]
    assert a.stage is Stage.HANDED_OFF
    tokens = a.on_delta("d", TokenDelta("r1", (8,)))
    assert Drop("p") in tokens and a.stage is Stage.DECODING
    done = a.on_delta("d", TokenDelta("r1", (9,), finished=True))
    assert Drop("d") in done and not a.holders
    assert a.end() == []  # nothing left to abort


def test_a_refused_reservation_fails_and_frees_prefill() -> None:
    a = Attempt(WORK, "d", "p", T)
    _, queue = (e for e in a.dispatch() if isinstance(e, Send))
    (fail,) = a.answered(queue, False)
    assert isinstance(fail, Fail) and fail.code is Code.RESOURCE_EXHAUSTED and "within 2s" in fail.message
    assert sends(a.end()) == [("d", C.Abort), ("p", C.Abort)]


def test_a_prefill_worker_lost_after_the_first_token_costs_a_recompute() -> None:
    a = Attempt(WORK, "d", "p", T)
    _, queue = (e for e in a.dispatch() if isinstance(e, Send))
    a.on_delta("p", TokenDelta("r1", (7,), prefilled=True))
    assert sends(a.worker_lost("p")) == [("p", C.Abort)]  # KvLost waits for the blocks
    granted = answer(a, a.answered(queue, True), TARGET)
    assert sends(granted) == [("d", C.Start), ("d", C.KvLost)]  # no SetTarget: prefill is gone


def test_a_fenced_worker_and_a_closed_attempt_change_nothing() -> None:
    a = Attempt(WORK, "d", None, T)
    assert sends(a.dispatch()) == [("d", C.AddLocal)]
    assert a.on_delta("elsewhere", TokenDelta("r1", (1,))) == []
    assert isinstance(a.worker_lost("d")[0], Relocate)
    assert a.on_delta("d", TokenDelta("r1", (1,))) == []  # over: only the end is left
    assert sends(a.end()) == [("d", C.Abort)]
    assert a.end() == [] and a.worker_lost("d") == []


def test_why_not_migrate() -> None:
    assert why_not_migrate(0, 3, True) is None
    assert "--migration-limit 3" in (why_not_migrate(3, 3, True) or "")
    assert why_not_migrate(3, 3, True, planned=True) is None
    assert "off" in (why_not_migrate(0, 0, True) or "")
    assert "no healthy colocated worker" in (why_not_migrate(0, 3, False, decode_role="colocated") or "")


# -- any order of events -------------------------------------------------------------------------
EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("answer"), st.integers(0, 9), st.sampled_from([None, True, False, TARGET])),
        st.tuples(st.just("fail"), st.integers(0, 9), st.sampled_from(list(Failure))),
        st.tuples(
            st.just("delta"),
            st.sampled_from(["p", "d", "x"]),
            st.sampled_from(["first", "tokens", "finished", "kv_lost", "error"]),
        ),
        st.tuples(st.just("lost"), st.sampled_from(["p", "d"])),
        st.just(("end",)),
    ),
    max_size=25,
)


@settings(max_examples=400, deadline=None)
@given(remote=st.booleans(), events=EVENTS)
def test_any_order_keeps_the_invariants(remote: bool, events: list[tuple[object, ...]]) -> None:
    a = Attempt(WORK, "d", "p" if remote else None, T)
    log: list[Effect] = a.dispatch()
    pending = [e for e in log if isinstance(e, Send)]
    held: set[str] = set()
    for ev in events:
        kind = ev[0]
        if kind == "answer" and pending:
            # each command is answered once (or fails once), in any order
            out = a.answered(pending.pop(int(ev[1]) % len(pending)), ev[2])  # type: ignore[call-overload]
        elif kind == "fail" and pending:
            sent = pending.pop(int(ev[1]) % len(pending))  # type: ignore[call-overload]
            out = a.call_failed(sent, ev[2], "boom")  # type: ignore[arg-type]
        elif kind == "delta":
            d = {
                "first": TokenDelta("r1", (7,), prefilled=True),
                "tokens": TokenDelta("r1", (8,)),
                "finished": TokenDelta("r1", (9,), finished=True),
                "kv_lost": TokenDelta("r1", (), kv_lost=True),
                "error": TokenDelta("r1", (), finished=True, error="oops"),
            }[str(ev[2])]
            out = a.on_delta(str(ev[1]), d)
        elif kind == "lost":
            out = a.worker_lost(str(ev[1])) if str(ev[1]) in a.holders else []
        elif kind == "end":
            out = a.end()
        else:
            out = []
        pending += [e for e in out if isinstance(e, Send)]
        log += out
    log += a.end()
    # holders: every Drop drops a holder, and the end leaves none
    for e in log:
        if isinstance(e, Hold):
            held.add(e.worker)
        elif isinstance(e, Drop):
            assert e.worker in held
            held.discard(e.worker)
    assert not held and not a.holders and a.stage is Stage.ENDED
    kinds = [type(e.command) for e in log if isinstance(e, Send)]
    for once in (C.SetTarget, C.Start, C.KvLost, C.AwaitReservation):
        assert kinds.count(once) <= 1
    assert sum(isinstance(e, (Fail, Relocate)) for e in log) <= 1
    # after a failure or a move, only aborts go out
    over = next((i for i, e in enumerate(log) if isinstance(e, (Fail, Relocate))), len(log))
    assert all(isinstance(e.command, C.Abort) for e in log[over:] if isinstance(e, Send))
    assert not any(isinstance(e, Deliver) for e in log[over:])
    # Start carries prefill's first token, and only once decode holds blocks
    for e in log:
        if isinstance(e, Send) and isinstance(e.command, C.Start):
            assert e.command.first_token == 7 and a.target is not None


def test_steady_tokens_need_no_decision() -> None:
    """Decode's tokens once it streams change nothing: ``steady`` lets drivers skip the machine;
    what does change something (the first decode token, the end, a loss) is never steady."""
    a = Attempt(WORK, "d", "p", T)
    a.dispatch()
    assert not a.steady("d", TokenDelta("r1", (8,)))  # the first: prefill is dropped on it
    assert Drop("p") in a.on_delta("d", TokenDelta("r1", (8,)))
    assert a.steady("d", TokenDelta("r1", (9,)))
    assert a.on_delta("d", TokenDelta("r1", (9,))) == [Deliver("d", TokenDelta("r1", (9,)))]
    for d in (
        TokenDelta("r1", (9,), finished=True),
        TokenDelta("r1", (), kv_lost=True),
        TokenDelta("r1", (), error="x"),
    ):
        assert not a.steady("d", d)
    assert not a.steady("p", TokenDelta("r1", (9,)))
    a.end()
    assert not a.steady("d", TokenDelta("r1", (9,)))


def test_a_command_error_reads_the_same_to_both_drivers() -> None:
    """``failure_of``: the one reading of a command's error the router and the simulator share."""
    assert failure_of(InvalidRequestError("max_tokens", "too big")) == (
        Failure.INVALID,
        "max_tokens: too big",
        "max_tokens",
    )
    assert failure_of(ValueError("already here")) == (Failure.VALUE, "already here", None)
    assert failure_of(TimeoutError())[0] is Failure.TIMEOUT
    assert failure_of(RuntimeError("x")) == (Failure.INTERNAL, "RuntimeError", None)
