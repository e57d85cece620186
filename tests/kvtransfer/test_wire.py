"""Control frames: round trips, every malformed input rejected as FrameError, and fuzzing."""

from __future__ import annotations

import pickle
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvtransfer import wire


def body(frame: bytes) -> bytes:
    (n,) = wire.LENGTH.unpack(frame[:4])
    assert n == len(frame) - 4
    return frame[4:]


def test_the_optional_end_flag_round_trips() -> None:
    for frame in (
        wire.encode("layer", id="a", layer=0, count=4, done=True),
        wire.encode("data", id="a", layer=3, first=0, count=2, done=True),
    ):
        assert wire.decode_body(body(frame))["done"] is True


def test_round_trip() -> None:
    f = wire.encode("begin", id="req-1", dst_blocks=[3, 1, 2], num_layers=4, layerwise=True)
    assert wire.decode_body(body(f)) == {
        "v": 1,
        "t": "begin",
        "id": "req-1",
        "dst_blocks": [3, 1, 2],
        "num_layers": 4,
        "layerwise": True,
    }


@pytest.mark.parametrize(
    "msg,match",
    [
        (
            {"v": 1, "t": "begin", "id": "x", "dst_blocks": [1], "num_layers": "4", "layerwise": True},
            "num_layers",
        ),
        (
            {"v": 1, "t": "begin", "id": "x", "dst_blocks": ["a"], "num_layers": 4, "layerwise": True},
            "dst_blocks",
        ),
        ({"v": 1, "t": "data", "id": "x", "layer": -1, "first": 0, "count": 1}, "layer"),
        ({"v": 1, "t": "data", "id": "x", "layer": 0, "first": 0, "count": 1, "done": 1}, "done"),
        ({"v": 1, "t": "layer", "id": "x", "layer": 0, "count": 1, "done": "yes"}, "done"),
        (
            {"v": 1, "t": "begin", "id": "x", "dst_blocks": [1], "num_layers": 4, "layerwise": True}
            | {"eager": True},
            "unexpected field",
        ),
        ({"v": 1, "t": "data", "id": "x", "layer": True, "first": 0, "count": 1}, "layer"),
        ({"v": 1, "t": "done"}, "missing field 'id'"),
        ({"v": 1, "t": "done", "id": "x", "extra": 1}, "unexpected field"),
        ({"v": 1, "t": "done", "id": ""}, "id"),
        ({"v": 2, "t": "done", "id": "x"}, "version"),
        ({"v": 1, "t": "exec", "id": "x"}, "unknown frame type"),
        ([1, 2, 3], "must be a map"),
    ],
)
def test_wrong_types_and_shapes(msg: object, match: str) -> None:
    with pytest.raises(wire.FrameError, match=match):
        wire.decode_body(msgpack.packb(msg))


def test_truncated_frame() -> None:
    b = body(wire.encode("done", id="abc"))
    with pytest.raises(wire.FrameError):
        wire.decode_body(b[:-2])


def test_oversize_length_prefix_is_refused_before_reading() -> None:
    with pytest.raises(wire.FrameError, match="length"):
        wire.check_length(struct.unpack(">I", b"\xff\xff\xff\xff")[0])
    with pytest.raises(wire.FrameError):
        wire.check_length(0)


def test_deep_nesting() -> None:
    with pytest.raises(wire.FrameError):
        wire.decode_body(b"\x91" * 2000 + b"\xc0")
    nested: object = {"v": 1, "t": "done", "id": "x"}
    for _ in range(10):
        nested = {"v": 1, "t": "welcome", "mac": b"m", "backend": "tcp", "info": {"a": nested}}
    with pytest.raises(wire.FrameError, match="nesting"):
        wire.decode_body(msgpack.packb(nested, use_bin_type=True))


class _Boom:
    def __reduce__(self) -> tuple[object, ...]:
        return (exec, ("raise SystemExit('unpickled!')",))


def test_pickle_payload_is_never_unpickled() -> None:
    with pytest.raises(wire.FrameError):
        wire.decode_body(pickle.dumps(_Boom()))


def test_msgpack_extension_types_are_refused() -> None:
    ext = msgpack.packb({"v": 1, "t": "done", "id": msgpack.ExtType(1, b"zz")})
    with pytest.raises(wire.FrameError):
        wire.decode_body(ext)


def test_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(wire.FrameError):
        wire.encode("done", id=5)


@settings(max_examples=1200, deadline=None)
@given(st.binary(min_size=1, max_size=512))
def test_fuzz_random_bytes_never_escape_as_other_errors(data: bytes) -> None:
    try:
        msg = wire.decode_body(data)
    except wire.FrameError:
        return
    wire.validate(msg)  # anything accepted is a valid frame


_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=20), st.binary(max_size=20)
)
_values = st.recursive(
    _json_leaf,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)


@settings(max_examples=1000, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["v", "t", "id", "layer", "first", "count", "dst_blocks", "x"]), _values, max_size=7
    )
)
def test_fuzz_structured_maps(msg: dict[str, object]) -> None:
    if "t" not in msg:
        msg["t"] = "data"
    packed = msgpack.packb(msg, use_bin_type=True)
    try:
        out = wire.decode_body(packed)
    except wire.FrameError:
        return
    assert out == msg  # accepted only when it is exactly a valid frame
    wire.validate(out)
