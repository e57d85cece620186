"""The worker -> router output channel's frames: round trip, authentication, hostile input."""

from __future__ import annotations

import contextlib
import pickle

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.worker import codec
from pdserve.worker.codec import (
    LENGTH,
    MAX_FRAME_BYTES,
    VERSION,
    ChannelError,
    check_welcome,
    decode_batch,
    decode_hello,
    encode_batch,
    encode_hello,
    encode_welcome,
)
from pdserve.worker.kv_events import MAX_KV_OPS, MAX_SNAPSHOT_KEYS
from pdserve.worker.messages import (
    KvEvents,
    Logprob,
    OutputBatch,
    PlacedWork,
    TokenDelta,
    TransferCounters,
    WorkerHealth,
    WorkerLoad,
    WorkerRole,
)

SECRET = b"0123456789abcdef-secret"
LOAD = WorkerLoad(
    "decode-0", WorkerRole.DECODE, "127.0.0.1:1", 2, 1, 100, 60, 5, WorkerHealth.DRAINING,
    TransferCounters(0.5, 7, (("peer_died", 1), ("timeout", 2)), (("shm", 100000), ("tcp", 23456))), 12.5,
    others=PlacedWork(3, 4100, 17, 40_960, 2 << 40),
)  # fmt: skip


def load_list(transfers: object = None, busy: object = 0.0, others: object = (0,) * 5) -> list[object]:
    """A load as the frame carries it, well formed but for what is passed."""
    return [
        "decode",
        "",
        0,
        0,
        0,
        0,
        0,
        "healthy",
        transfers,
        busy,
        list(others) if isinstance(others, tuple) else others,
    ]


def body(frame: bytes) -> bytes:
    (n,) = LENGTH.unpack(frame[:4])
    assert n == len(frame) - 4
    return frame[4:]


def test_round_trip_keeps_every_field() -> None:
    batch = OutputBatch(
        (
            TokenDelta("a", (1, 2), None, False, None, None, 3, True, None),
            TokenDelta(
                "b", (), (Logprob(5, -0.25, ((5, -0.25), (7, -1.5))),), True, "stop", 9, 0, False, None
            ),
            TokenDelta("c", (), None, True, "error", None, 0, False, "KV transfer failed"),
        ),
        LOAD,
    )
    assert decode_batch(body(encode_batch("decode-0", batch)), "decode-0") == batch
    assert batch.load.transfers is not None and batch.load.transfers.bytes == 123456  # the backends' sum
    # the hostile cases below alter one field of this well-formed load
    well_formed = msgpack.packb({"v": VERSION, "w": "decode-0", "d": [], "l": load_list()})
    plain = decode_batch(well_formed, "decode-0")
    assert plain.load.busy_s == 0.0 and plain.load.transfers is None
    assert plain.load.others == PlacedWork()  # one router: nothing placed by others


def test_hello_and_welcome_authenticate_both_ends_with_the_shared_secret() -> None:
    challenge, nonce = b"c" * 32, b"n" * 32
    hello = body(encode_hello("prefill-0", SECRET, challenge, nonce))
    assert decode_hello(hello, SECRET, challenge) == ("prefill-0", nonce)
    with pytest.raises(ChannelError, match="authentication"):
        decode_hello(
            body(encode_hello("prefill-0", b"another-secret-xxxxxxx", challenge, nonce)), SECRET, challenge
        )
    with pytest.raises(ChannelError, match="authentication"):  # replayed against a new challenge
        decode_hello(hello, SECRET, b"d" * 32)
    # The router proves the secret back, bound to the worker's own challenge and id.
    check_welcome(body(encode_welcome(SECRET, nonce, "prefill-0")), SECRET, nonce, "prefill-0")
    for welcome in (
        encode_welcome(b"another-secret-xxxxxxx", nonce, "prefill-0"),
        encode_welcome(SECRET, b"m" * 32, "prefill-0"),
        encode_welcome(SECRET, nonce, "prefill-1"),
    ):
        with pytest.raises(ChannelError, match="authentication"):
            check_welcome(body(welcome), SECRET, nonce, "prefill-0")


def test_a_frame_claiming_another_worker_is_refused() -> None:
    frame = body(encode_batch("decode-0", OutputBatch((), LOAD)))
    with pytest.raises(ChannelError):
        decode_batch(frame, "decode-1")


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps({"v": 3}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb(
            {
                "v": VERSION,
                "w": "decode-0",
                "d": [["a", [-1], None, False, None, None, 0, False, None, False]],
                "l": [],
            }
        ),
        msgpack.packb({"v": VERSION, "w": "decode-0", "d": "x", "l": load_list()}),
        msgpack.packb({"v": VERSION - 1, "w": "decode-0", "d": [], "l": load_list()}),
        msgpack.packb({"v": VERSION + 1, "w": "decode-0", "d": [], "l": load_list()}),
        msgpack.packb({"v": VERSION, "w": "decode-0", "d": [], "l": ["boss", *load_list()[1:]]}),
        msgpack.packb({"v": VERSION, "w": "decode-0", "d": [], "l": load_list()[:9]}),  # older shapes
        msgpack.packb({"v": VERSION, "w": "decode-0", "d": [], "l": load_list()[:10]}),
        msgpack.packb({"v": VERSION, "w": "decode-0", "d": [], "l": [*load_list(), []]}),
        *(  # the other replicas' work: wrong shape, negative, not an integer, boolean
            msgpack.packb({"v": VERSION, "w": "decode-0", "d": [], "l": load_list(others=o)})
            for o in (
                None,
                [],
                [0, 0, 0, 0],
                [0, 0, 0, 0, 0, 0],
                (0, -1, 0, 0, 0),
                (0, 0, 0, 0, -(2**63)),
                (0, 0, 1.0, 0, 0),
                (True, 0, 0, 0, 0),
                (0, 0, 0, "7", 0),
                (0, 0, 0, 0, None),
                [[0], 0, 0, 0, 0],
                {"prefills": 0},
            )
        ),
        *(  # busy seconds: negative, NaN, infinite, not a float
            msgpack.packb({"v": VERSION, "w": "decode-0", "d": [], "l": load_list(busy=b)})
            for b in (-1.0, float("nan"), float("inf"), 3, "1.0", None)
        ),
        msgpack.packb(msgpack.ExtType(5, b"xx")),
        b"",
        *(  # transfer counters: wrong shape, negative, NaN, oversized or malformed lists
            msgpack.packb({"v": VERSION, "w": "decode-0", "d": [], "l": load_list(transfers=t)})
            for t in (
                [2.0],
                [0.0, 0, []],
                [1, 0.0, 0, [], []],  # the shape with a separate byte total (no longer sent)
                [0.0, -1, [], []],
                [-0.5, 0, [], []],
                [float("nan"), 0, [], []],
                [0.0, 0, [["x", 1]] * 33, []],
                [0.0, 0, [["x", -1]], []],
                [0.0, 0, [[7, 1]], []],
                [1, 0, [], []],
                [0.0, 0, [], [["tcp", -1]]],
                [0.0, 0, [], [["t" * 65, 1]]],
                [0.0, 0, [], "tcp"],
            )
        ),
    ],
)
def test_malformed_frames_raise_channel_error(payload: bytes) -> None:
    with pytest.raises(ChannelError):
        decode_batch(payload, "decode-0")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decoder_never_raises_anything_else(data: bytes) -> None:
    with contextlib.suppress(ChannelError):
        decode_batch(data, "decode-0")


KEY = bytes(range(16))  # a prefix-cache key: KEY_BYTES long


def kv_frame(kv: object) -> bytes:
    return msgpack.packb({"v": VERSION, "w": "decode-0", "d": [], "l": load_list(), "k": kv})  # type: ignore[no-any-return]


def test_prefix_cache_events_round_trip_and_are_left_out_when_none() -> None:
    other = bytes(16)
    for kv in (KvEvents(((True, KEY), (False, KEY), (True, other))), KvEvents((), (KEY, other)), KvEvents()):
        batch = OutputBatch((), LOAD, kv)
        assert decode_batch(body(encode_batch("decode-0", batch)), "decode-0") == batch
    plain = encode_batch("decode-0", OutputBatch((), LOAD))
    assert b"\xa1k" not in plain and decode_batch(body(plain), "decode-0").kv is None  # no "k" key at all


@pytest.mark.parametrize(
    "kv",
    [
        None,
        [],
        [[]],
        [[], [], []],
        {"ops": []},
        [[[True, KEY[:15]]], None],  # a short key
        [[[True, KEY + b"x"]], None],  # a long one
        [[[True, "0123456789abcdef"]], None],  # a string, not bytes
        [[[1, KEY]], None],  # not a bool
        [[[True, KEY, 0]], None],
        [[[True]], None],
        [["x"], None],
        [[], [KEY[:8]]],
        [[], KEY],
        [[], [[KEY]]],
        [None, None],
    ],
)
def test_malformed_prefix_cache_events_are_refused(kv: object) -> None:
    with pytest.raises(ChannelError):
        decode_batch(kv_frame(kv), "decode-0")


def test_more_prefix_cache_events_than_a_frame_may_carry_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "MAX_KV_OPS", 2)
    monkeypatch.setattr(codec, "MAX_SNAPSHOT_KEYS", 2)
    assert decode_batch(kv_frame([[[True, KEY]] * 2, [KEY] * 2]), "decode-0").kv == KvEvents(
        ((True, KEY),) * 2, (KEY,) * 2
    )
    for kv in ([[[True, KEY]] * 3, None], [[], [KEY] * 3]):
        with pytest.raises(ChannelError):
            decode_batch(kv_frame(kv), "decode-0")


def test_the_most_a_worker_sends_fits_in_one_frame() -> None:
    """A full snapshot plus a full log of ops (more than a worker ever puts in one frame: it
    sends one or the other) encodes under the frame limit, and the router takes it."""
    kv = KvEvents(((True, KEY),) * MAX_KV_OPS, (KEY,) * MAX_SNAPSHOT_KEYS)
    frame = body(encode_batch("decode-0", OutputBatch((), LOAD, kv)))
    assert len(frame) < MAX_FRAME_BYTES // 2
    got = decode_batch(frame, "decode-0").kv
    assert got is not None and len(got.ops) == MAX_KV_OPS and len(got.snapshot or ()) == MAX_SNAPSHOT_KEYS
