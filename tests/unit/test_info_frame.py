"""The worker's info frame (``worker/info_codec.py``): every field round-trips, and a hostile
frame is refused naming what is wrong, never building a ``WorkerInfo`` from it."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.worker.codec import LENGTH, VERSION, ChannelError
from pdserve.worker.command_codec import decode_from_worker
from pdserve.worker.info_codec import encode_info, info_from
from pdserve.worker.messages import WorkerInfo, WorkerRole

INFO = WorkerInfo("decode-0", WorkerRole.DECODE, "10.0.0.2:7000", "/models/m", "LlamaForCausalLM", 49152,
                  2048, 16, "bfloat16", 4096, 20, True, 1234, "node-a", 256, 2, 2)  # fmt: skip


def body(frame: bytes) -> bytes:
    (n,) = LENGTH.unpack(frame[: LENGTH.size])
    return frame[LENGTH.size :][:n]


def test_every_field_round_trips_and_the_channel_tells_it_apart() -> None:
    assert decode_from_worker(body(encode_info(INFO)), "decode-0") == INFO


def test_an_info_frame_naming_another_worker_is_refused() -> None:
    with pytest.raises(ChannelError, match="not the worker that sent it"):
        decode_from_worker(body(encode_info(INFO)), "decode-1")


def _wire(**changes: Any) -> list[Any]:
    values = [v.value if isinstance(v, WorkerRole) else v for v in dataclasses.astuple(INFO)]
    names = [f.name for f in dataclasses.fields(WorkerInfo)]
    for k, v in changes.items():
        values[names.index(k)] = v
    return values


@pytest.mark.parametrize(
    "msg",
    [
        {"v": VERSION, "i": _wire(role="leader")},
        {"v": VERSION, "i": _wire(kv_blocks=-1)},
        {"v": VERSION, "i": _wire(kv_blocks=True)},
        {"v": VERSION, "i": _wire(tp=1 << 63)},
        {"v": VERSION, "i": _wire(has_tokenizer=1)},
        {"v": VERSION, "i": _wire(model_dir="x" * 5000)},
        {"v": VERSION, "i": _wire(node=b"bytes")},
        {"v": VERSION, "i": _wire()[:-1]},
        {"v": VERSION, "i": _wire(), "extra": 1},
        {"v": VERSION + 1, "i": _wire()},
    ],
)
def test_hostile_info_frames_are_refused(msg: dict[str, Any]) -> None:
    with pytest.raises(ChannelError):
        info_from(msg, "decode-0")


FIELD = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.text(max_size=8),
                  st.binary(max_size=4))  # fmt: skip


@given(st.lists(FIELD, max_size=20))
def test_random_field_lists_never_build_an_info(values: list[Any]) -> None:
    frame = msgpack.packb({"v": VERSION, "i": values}, use_bin_type=True)
    try:
        info = decode_from_worker(frame, "decode-0")
    except ChannelError:
        return
    assert isinstance(info, WorkerInfo) and info.worker_id == "decode-0"  # only a well-formed one
