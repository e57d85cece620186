"""What rank 0 of a tensor-parallel worker tells its other ranks, and what they answer (pure).

Rank 0 owns scheduling, the block pool and sampling; the other ranks hold their shards and run
the same forward on the same step. Per step they receive one ``Step``: the chunks to run (ids,
positions, block tables — the plan, not the requests) and the KV pushes whose layers they ship
as they compute them. ``Op`` carries a room's own message (the worker's KV transport commands)
as opaque bytes the room encodes and checks itself; ``Stop`` ends a rank.

Frames are msgpack lists, bounded and schema-checked: ``[kind, ...fields]``. A rank's answer to
an ``Op`` is bytes the room decodes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from pdserve.model_runtime.scheduler.plan import ScheduledChunk

MAX_FRAME_BYTES = 64 << 20  # a step of every token of a long prompt, block tables included


class Kind(enum.IntEnum):
    STEP = 1
    OP = 2
    STOP = 3


@dataclass(frozen=True)
class Step:
    chunks: tuple[ScheduledChunk, ...]
    layer_pushes: tuple[str, ...] = ()  # transfer ids shipped layer by layer during this step


@dataclass(frozen=True)
class Op:
    payload: bytes


@dataclass(frozen=True)
class Stop:
    pass


Message = Step | Op | Stop


class MessageError(ValueError):
    """Bytes that are not a valid rank message."""


def encode(msg: Message) -> bytes:
    body: list[Any]
    if isinstance(msg, Step):
        chunks = [
            [list(c.token_ids), c.start_pos, list(c.block_table), c.sample, c.pending] for c in msg.chunks
        ]
        body = [Kind.STEP, chunks, list(msg.layer_pushes)]
    elif isinstance(msg, Op):
        body = [Kind.OP, msg.payload]
    else:
        body = [Kind.STOP]
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise MessageError("expected a list of integers")
    return tuple(v)


def decode(frame: bytes) -> Message:
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=MAX_FRAME_BYTES)
    except Exception as e:  # msgpack's errors have no common base
        raise MessageError(f"undecodable rank message: {e}") from None
    if not isinstance(body, list) or not body or body[0] not in Kind._value2member_map_:
        raise MessageError("a rank message is [kind, ...]")
    kind = Kind(body[0])
    if kind is Kind.STOP:
        return Stop()
    if kind is Kind.OP:
        if len(body) != 2 or not isinstance(body[1], bytes):
            raise MessageError("op: [2, payload bytes]")
        return Op(body[1])
    if len(body) != 3 or not isinstance(body[1], list) or not isinstance(body[2], list):
        raise MessageError("step: [1, chunks, layer pushes]")
    chunks = []
    for i, c in enumerate(body[1]):
        if not isinstance(c, list) or len(c) != 5 or type(c[1]) is not int:
            raise MessageError("step chunk: [token ids, start, block table, sample, pending]")
        if not isinstance(c[3], bool) or not isinstance(c[4], bool):
            raise MessageError("step chunk: sample and pending are booleans")
        chunks.append(ScheduledChunk(str(i), _ints(c[0]), c[1], _ints(c[2]), c[3], c[4]))
    if not all(isinstance(t, str) for t in body[2]):
        raise MessageError("step: layer pushes are transfer ids")
    return Step(tuple(chunks), tuple(body[2]))
