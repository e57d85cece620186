"""The router -> worker command contract: exact round trips, and every malformed frame refused
with a ``ChannelError`` (never another exception, never a half-built command)."""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from pdserve.worker.codec import LENGTH, VERSION, ChannelError
from pdserve.worker.command_codec import (
    CommandFrameError,
    decode_command,
    decode_from_worker,
    encode_answer,
    encode_command,
    encode_error,
)
from pdserve.worker.commands import (
    Abort,
    AddLocal,
    AwaitReservation,
    CommandError,
    ErrorKind,
    KvLost,
    Prefill,
    QueueReservation,
    Release,
    SetTarget,
    Start,
    Withdraw,
)
from pdserve.worker.messages import KVTarget, WorkItem

ids = st.text(min_size=1, max_size=40)
i64 = st.integers(-(1 << 63), (1 << 63) - 1)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
params = st.builds(
    SamplingParams,
    max_tokens=i64, temperature=finite, top_k=i64, top_p=finite, min_p=finite,
    repetition_penalty=finite, frequency_penalty=finite, presence_penalty=finite,
    seed=st.none() | st.integers(SEED_MIN, SEED_MAX),  # the whole range the APIs take, not just int64
    stop=st.lists(st.text(max_size=20), max_size=4).map(tuple),
    stop_token_ids=st.lists(i64, max_size=4).map(tuple), include_stop_str_in_output=st.booleans(),
    ignore_eos=st.booleans(), min_tokens=i64, logprobs=st.none() | i64,
)  # fmt: skip
token_lists = st.lists(st.integers(0, (1 << 31) - 1), max_size=64).map(tuple)
works = st.builds(WorkItem, ids, token_lists, params, i64, token_lists)
targets = st.builds(
    KVTarget, ids, st.text(max_size=40), st.lists(st.text(max_size=10), max_size=4).map(tuple),
    st.lists(st.integers(0, (1 << 31) - 1), max_size=64).map(tuple),
)  # fmt: skip
commands = st.one_of(
    st.builds(Prefill, works, st.none() | targets),
    st.builds(SetTarget, ids, targets),
    st.builds(Withdraw, ids),
    st.builds(QueueReservation, works, ids, finite),
    st.builds(AwaitReservation, ids),
    st.builds(Start, ids, st.integers(0, (1 << 31) - 1), st.integers(0, 1 << 40)),
    st.builds(KvLost, ids),
    st.builds(AddLocal, works),
    st.builds(Abort, ids),
    st.builds(Release),
)


def test_a_seed_crosses_intact_over_the_whole_range_the_api_takes() -> None:
    for seed in (SEED_MIN, -1, 2**63 - 1, 2**63, SEED_MAX):
        cmd = AddLocal(WorkItem("r", (1, 2), SamplingParams(seed=seed), 0, ()))
        assert decode_command(body(encode_command(7, cmd))) == (7, cmd)


def body(frame: bytes) -> bytes:
    (n,) = LENGTH.unpack(frame[: LENGTH.size])
    assert n == len(frame) - LENGTH.size
    return frame[LENGTH.size :]


@given(st.integers(0, 1 << 40), commands)
@settings(max_examples=300)
def test_every_command_round_trips_exactly(call_id: int, cmd: Any) -> None:
    assert decode_command(body(encode_command(call_id, cmd))) == (call_id, cmd)


@given(st.integers(0, 1 << 40), st.none() | st.booleans() | targets)
def test_answers_round_trip(call_id: int, value: Any) -> None:
    assert decode_from_worker(body(encode_answer(call_id, value)), "w") == (call_id, value)


def test_errors_round_trip_and_map_to_exceptions() -> None:
    err = CommandError(ErrorKind.INVALID, "must be >= 0", "temperature")
    assert decode_from_worker(body(encode_error(7, err)), "w") == (7, err)
    exc = err.request_fault()
    assert isinstance(exc, InvalidRequestError) and exc.field == "temperature"
    assert isinstance(CommandError(ErrorKind.VALUE, "x").request_fault(), ValueError)
    assert CommandError(ErrorKind.FAILED, "loop stopped").request_fault() is None


def frame_body(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def command(kind: str, args: Any) -> bytes:
    return frame_body({"v": VERSION, "c": 1, "k": kind, "a": args})


GOOD_WORK = [
    ["r", [1, 2], [16, 1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, None, [], [], False, False, 0, None], 0, []],
    None,
]
HOSTILE: list[tuple[str, bytes]] = [
    ("pickle payload", pickle.dumps({"v": VERSION, "c": 1, "k": "abort", "a": ["r"]})),
    ("not a map", frame_body([1, 2, 3])),
    ("old version", frame_body({"v": VERSION - 1, "c": 1, "k": "abort", "a": ["r"]})),
    ("extra key", frame_body({"v": VERSION, "c": 1, "k": "abort", "a": ["r"], "x": 1})),
    ("negative call id", frame_body({"v": VERSION, "c": -1, "k": "abort", "a": ["r"]})),
    ("unknown command", frame_body({"v": VERSION, "c": 1, "k": "shutdown", "a": []})),
    ("wrong arity", frame_body({"v": VERSION, "c": 1, "k": "abort", "a": ["r", True]})),
    ("empty id", frame_body({"v": VERSION, "c": 1, "k": "abort", "a": [""]})),
    ("huge id", frame_body({"v": VERSION, "c": 1, "k": "abort", "a": ["x" * 300]})),
    ("id of wrong type", frame_body({"v": VERSION, "c": 1, "k": "kv_lost", "a": [7]})),
    ("bool for int", frame_body({"v": VERSION, "c": 1, "k": "start", "a": ["r", True, 0]})),
    ("negative token", frame_body({"v": VERSION, "c": 1, "k": "start", "a": ["r", -5, 0]})),
    ("nan timeout", command("queue_reservation", [GOOD_WORK[0], "t", float("nan")])),
    ("params short", command("add_local", [["r", [1], [16, 1.0], 0, []]])),
    ("prompt of strings", command("add_local", [["r", ["a"], GOOD_WORK[0][2], 0, []]])),
    ("work without output", command("add_local", [["r", [1], GOOD_WORK[0][2], 0]])),
    ("output of floats", command("add_local", [["r", [1], GOOD_WORK[0][2], 0, [1.5]]])),
    ("deep nesting", frame_body({"v": VERSION, "c": 1, "k": "prefill", "a": [[[[[[[[[[1]]]]]]]]], None]})),
    ("ext type", b"\x84\xa1v\x03\xa1c\x01\xa1k\xa5abort\xa1a\xc7\x01\x05x"),
    ("truncated", frame_body({"v": VERSION, "c": 1, "k": "abort", "a": ["r"]})[:-2]),
    ("empty", b""),
]  # fmt: skip


@pytest.mark.parametrize("name,raw", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_command_frames_are_refused(name: str, raw: bytes) -> None:
    with pytest.raises(ChannelError):
        decode_command(raw)


def test_a_readable_call_id_is_kept_for_the_error_answer() -> None:
    with pytest.raises(CommandFrameError) as e:
        decode_command(frame_body({"v": VERSION, "c": 42, "k": "launch_missiles", "a": []}))
    assert e.value.call_id == 42


@given(st.recursive(st.none() | st.booleans() | i64 | st.floats() | st.text() | st.binary(),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=4),
                    max_leaves=20))  # fmt: skip
@settings(max_examples=500)
def test_arbitrary_msgpack_never_escapes_as_another_exception(obj: Any) -> None:
    wrapped = [{"v": VERSION, "c": 1, "k": k, "a": obj} for k in ("prefill", "start", "queue_reservation")]
    for candidate in (obj, *wrapped):
        with contextlib.suppress(ChannelError):
            decode_command(frame_body(candidate))
