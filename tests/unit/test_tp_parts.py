"""A request's hand-off split into parts (``kvtransfer.parts``) and the ranks' messages
(``model_runtime.parallel.messages``, ``worker.rank_ops``): every transfer is reported once,
every part's record is released exactly once whatever order outcomes and forgets come in, and
hostile frames are refused."""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvtransfer.parts import Part, PartTable, part_id
from pdserve.kvtransfer.states import Completions, FailureCause
from pdserve.model_runtime.parallel import messages
from pdserve.model_runtime.scheduler.plan import ScheduledChunk
from pdserve.worker import rank_ops as ops

EVENTS = st.lists(
    st.tuples(st.sampled_from(["finish", "fail", "forget"]), st.integers(0, 2), st.integers(0, 3)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(events=EVENTS, receiving=st.booleans())
def test_each_transfer_is_reported_once_and_each_part_released_once(
    events: list[tuple[str, int, int]], receiving: bool
) -> None:
    table = PartTable()
    parts = {t: [Part(p % 2, part_id(f"t{t}", p, 0, False)) for p in range(1 + t)] for t in range(3)}
    for t, ps in parts.items():
        table.add(f"t{t}", ps, receiving)
    reported: list[str] = []
    released: list[str] = []
    forgotten: set[str] = set()
    for kind, t, p in events:
        tid = f"t{t}"
        if kind == "forget":
            forgotten.add(tid)
            released += [x.id for x in table.forget(tid)]
            continue
        pid = parts[t][p % len(parts[t])].id
        c = Completions()
        if kind == "fail":
            c.failed[pid] = FailureCause.CANCELLED
        else:
            (c.finished_receiving if receiving else c.finished_sending).add(pid)
        out, rel = table.fold([c])
        released += [x.id for x in rel]
        wrong_side = out.finished_sending if receiving else out.finished_receiving
        assert not wrong_side
        reported += [*out.finished_receiving, *out.finished_sending, *out.failed]
    assert len(reported) == len(set(reported))  # never twice
    assert len(released) == len(set(released))
    # Whatever ended and was forgotten is released; the rest is still held.
    for t, ps in parts.items():
        for x in ps:
            assert (x.id in released) == (f"t{t}" in forgotten and x.id in _ended(events, parts, t))
    finished = all(
        f"t{t}" in forgotten and len(_ended(events, parts, t)) == len(ps) for t, ps in parts.items()
    )
    assert (len(table) == 0) == finished


def _ended(events: list[tuple[str, int, int]], parts: dict[int, list[Part]], t: int) -> set[str]:
    return {parts[t][p % len(parts[t])].id for kind, tt, p in events if tt == t and kind != "forget"}


def test_a_part_or_transfer_already_in_flight_is_refused() -> None:
    table = PartTable()
    table.add("a", [Part(0, "a#0>0")], receiving=True)
    with pytest.raises(ValueError, match="already in flight"):
        table.add("a", [Part(0, "x")], receiving=True)
    with pytest.raises(ValueError, match="already in flight"):
        table.add("b", [Part(1, "a#0>0")], receiving=True)
    with pytest.raises(ValueError, match="no parts"):
        table.add("c", [], receiving=True)


def test_a_tp1_to_tp1_hand_off_keeps_the_transfer_id_on_the_wire() -> None:
    assert part_id("kv-r1", 0, 0, whole=True) == "kv-r1"
    assert part_id("kv-r1", 1, 0, whole=False) == "kv-r1#1>0"


def test_rank_messages_round_trip() -> None:
    chunk = ScheduledChunk("0", (5, 6, 7), 0, (3,), True, False)
    pending = ScheduledChunk("1", (-1,), 9, (4, 5), True, True)
    msg = messages.Step((chunk, pending), ("kv-a#1>0",))
    assert messages.decode(messages.encode(msg)) == msg
    assert messages.decode(messages.encode(messages.Stop())) == messages.Stop()
    assert messages.decode(messages.encode(messages.Op(b"x"))) == messages.Op(b"x")
    batch = [
        (1, ops.ExpectPart("p", (1, 2), 1, 1, False)),
        (2, ops.SendPart("q", "h:1", (1,), (2,), True, ("tcp",), 0, 1, 2, False)),
        (1, ops.Poll()),
        (2, ops.ForgetPart("q")),
    ]
    frame = ops.encode_ops(batch)
    assert ops.decode_ops(frame, 1) == [batch[0][1], batch[2][1]]
    assert ops.decode_ops(frame, 2) == [batch[1][1], batch[3][1]]
    answer = ops.RankAnswer("h:2", Completions({"a"}, set(), {"b": FailureCause.CANCELLED}), 3, 10, 20, 1, 2)
    assert ops.decode_answer(ops.encode_answer(answer)) == answer


@pytest.mark.parametrize(
    "body",
    [
        [],
        [9],
        [1, [[[1], "x", [1], True, False]], []],  # a start that is not an int
        [1, [[[1], 0, [1], 1, False]], []],  # sample not a bool
        [1, [[["a"], 0, [1], True, False]], []],  # token ids not ints
        [2, "not bytes"],
        {"k": 1},
    ],
)
def test_hostile_rank_messages_are_refused(body: object) -> None:
    with pytest.raises(messages.MessageError):
        messages.decode(msgpack.packb(body))


@pytest.mark.parametrize(
    "body",
    [
        {"k": 1},
        [[1]],
        [["1", [6]]],
        [[1, [2, "p", [1], 0, 1]]],  # expect without whole
        [[1, [2, "p", [-1], 0, 1, False]]],  # a negative block id
        [[1, [3, "p", "h", [1], [1], True, [5], 0, 0, 1, False]]],  # offers not names
        [[1, [99]]],
    ],
)
def test_hostile_rank_ops_are_refused(body: object) -> None:
    with pytest.raises(ops.RankOpError):
        ops.decode_ops(msgpack.packb(body), 1)
