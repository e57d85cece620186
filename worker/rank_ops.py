"""What rank 0 of a tensor-parallel worker asks of its other ranks' KV transports (pure data).

Each engine call on the worker's transport (``ranked_transport``) becomes one ``RankOps``
message to every other rank: the ops for each rank, tagged with it, so one message reaches
all and each rank runs its own. Each rank answers with ``RankAnswer``: the address it listens
on, the outcomes of its parts since the last poll, its record count and byte counters.

The wire form is msgpack lists with schema checks; nothing is pickled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]

from pdserve.kvtransfer.states import Completions, FailureCause

MAX_OP_BYTES = 16 << 20


class OpKind(enum.IntEnum):
    LISTEN = 1
    EXPECT = 2
    SEND = 3
    CANCEL = 4
    FORGET = 5
    POLL = 6
    CLOSE = 7


@dataclass(frozen=True)
class Listen:
    pass


@dataclass(frozen=True)
class ExpectPart:
    part_id: str
    blocks: tuple[int, ...]
    dst_head: int
    count: int
    whole: bool  # the part fills every head of the destination blocks (no slice)


@dataclass(frozen=True)
class SendPart:
    part_id: str
    peer: str
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    layerwise: bool
    offers: tuple[str, ...]
    src_head: int
    dst_head: int
    count: int
    whole: bool


@dataclass(frozen=True)
class CancelPart:
    part_id: str


@dataclass(frozen=True)
class ForgetPart:
    part_id: str


@dataclass(frozen=True)
class Poll:
    pass


@dataclass(frozen=True)
class Close:
    pass


RankOp = Listen | ExpectPart | SendPart | CancelPart | ForgetPart | Poll | Close


@dataclass(frozen=True)
class RankAnswer:
    address: str = ""
    completions: Completions = field(default_factory=Completions)
    records: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    descriptors_sent: int = 0  # copy operations (``TransferStats``)
    descriptors_received: int = 0


class RankOpError(ValueError):
    pass


def _op_body(op: RankOp) -> list[Any]:
    if isinstance(op, ExpectPart):
        return [OpKind.EXPECT, op.part_id, list(op.blocks), op.dst_head, op.count, op.whole]
    if isinstance(op, SendPart):
        return [
            OpKind.SEND, op.part_id, op.peer, list(op.src_blocks), list(op.dst_blocks), op.layerwise,
            list(op.offers), op.src_head, op.dst_head, op.count, op.whole,
        ]  # fmt: skip
    if isinstance(op, CancelPart | ForgetPart):
        return [OpKind.CANCEL if isinstance(op, CancelPart) else OpKind.FORGET, op.part_id]
    kind = {Listen: OpKind.LISTEN, Poll: OpKind.POLL, Close: OpKind.CLOSE}[type(op)]
    return [kind]


def encode_ops(ops: list[tuple[int, RankOp]]) -> bytes:
    """``(rank, op)`` pairs as one message for every rank."""
    out: bytes = msgpack.packb([[rank, _op_body(op)] for rank, op in ops], use_bin_type=True)
    return out


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
        raise RankOpError("expected a list of block ids")
    return tuple(v)


def _typed(body: list[Any], *types: type) -> None:
    if len(body) != len(types) + 1 or not all(
        isinstance(v, t) and not (t is int and isinstance(v, bool))
        for v, t in zip(body[1:], types, strict=True)
    ):
        raise RankOpError(f"malformed rank op {body[0]!r}")


def _decode_op(body: Any) -> RankOp:
    if not isinstance(body, list) or not body or body[0] not in OpKind._value2member_map_:
        raise RankOpError("a rank op is [kind, ...]")
    kind = OpKind(body[0])
    if kind is OpKind.EXPECT:
        _typed(body, str, list, int, int, bool)
        return ExpectPart(body[1], _ints(body[2]), body[3], body[4], body[5])
    if kind is OpKind.SEND:
        _typed(body, str, str, list, list, bool, list, int, int, int, bool)
        if not all(isinstance(o, str) for o in body[6]):
            raise RankOpError("send: offers are backend names")
        return SendPart(
            body[1], body[2], _ints(body[3]), _ints(body[4]), body[5], tuple(body[6]), body[7], body[8],
            body[9], body[10],
        )  # fmt: skip
    if kind in (OpKind.CANCEL, OpKind.FORGET):
        _typed(body, str)
        return CancelPart(body[1]) if kind is OpKind.CANCEL else ForgetPart(body[1])
    _typed(body)
    if kind is OpKind.LISTEN:
        return Listen()
    return Poll() if kind is OpKind.POLL else Close()


def decode_ops(frame: bytes, rank: int) -> list[RankOp]:
    """The ops of ``frame`` addressed to ``rank``, in order."""
    try:
        raw = msgpack.unpackb(frame, raw=False, max_bin_len=MAX_OP_BYTES, max_str_len=MAX_OP_BYTES)
    except Exception as e:  # msgpack's errors have no common base
        raise RankOpError(f"undecodable rank ops: {e}") from None
    if not isinstance(raw, list):
        raise RankOpError("rank ops are a list")
    out = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2 or type(item[0]) is not int:
            raise RankOpError("a rank op is addressed [rank, op]")
        if item[0] == rank:
            out.append(_decode_op(item[1]))
    return out


def encode_answer(a: RankAnswer) -> bytes:
    c = a.completions
    body = [
        a.address, sorted(c.finished_sending), sorted(c.finished_receiving),
        {k: v.value for k, v in c.failed.items()}, a.records, a.bytes_sent, a.bytes_received,
        a.descriptors_sent, a.descriptors_received,
    ]  # fmt: skip
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def decode_answer(frame: bytes) -> RankAnswer:
    try:
        b = msgpack.unpackb(frame, raw=False, max_bin_len=MAX_OP_BYTES, max_str_len=MAX_OP_BYTES)
        ok = isinstance(b, list) and len(b) == 9 and isinstance(b[3], dict)
        if not ok:
            raise RankOpError("a rank answer is [address, sent, received, failed, records, bytes...]")
        failed = {str(k): FailureCause(v) for k, v in b[3].items()}
        counters = (int(v) for v in b[4:9])
        return RankAnswer(str(b[0]), Completions(set(b[1]), set(b[2]), failed), *counters)
    except RankOpError:
        raise
    except Exception as e:  # a malformed answer: the rank is not to be trusted further
        raise RankOpError(f"undecodable rank answer: {e}") from None
