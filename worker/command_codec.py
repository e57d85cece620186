"""The wire form of the router's commands (``pdserve.worker.commands``) and their answers
(msgpack, never pickle).

Commands travel on the worker's authenticated channel (``pdserve.worker.push`` /
``pdserve.router.outputs``), the same TCP connection that carries its outputs, so the commands
for one worker arrive in the order the router sent them. A command frame is
``{"v", "c": call id, "k": kind, "a": [arguments]}``; the worker answers each with
``{"v", "r": call id, "ok": true, "x": value}`` or
``{"v", "r": call id, "ok": false, "e": error kind, "m": message, "f": field | nil}``.

Decoding checks every frame against the exact schema of its kind (types, lengths, caps,
nesting); anything else is a ``ChannelError`` and never reaches an engine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pdserve.model_runtime.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from pdserve.model_runtime.structured.constraint import MAX_SPEC_BYTES, Constraint, ConstraintKind
from pdserve.worker.codec import MAX_FRAME_BYTES, VERSION, ChannelError, batch_from, frame, unpack
from pdserve.worker.commands import (
    Abort,
    AddLocal,
    Answer,
    AwaitReservation,
    Command,
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
from pdserve.worker.info_codec import info_from, is_info
from pdserve.worker.messages import KVTarget, OutputBatch, WorkerInfo, WorkItem

MAX_COMMAND_BYTES = 16 << 20
MAX_ID_CHARS = 256
MAX_TOKENS = 1 << 22  # prompt token ids in one command
MAX_LIST = 4096  # stop strings, stop token ids, backends, ...
MAX_TP = 8  # a worker's ranks
MAX_STOP_CHARS = 1024
MAX_MESSAGE_CHARS = 4096


# -- checks ----------------------------------------------------------------------------------
def _str(x: Any, cap: int = MAX_ID_CHARS) -> str:
    if not isinstance(x, str) or len(x) > cap:
        raise ChannelError("expected a string")
    return x


def _id(x: Any) -> str:
    s = _str(x)
    if not s:
        raise ChannelError("expected a non-empty id")
    return s


def _int(x: Any, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise ChannelError("expected an integer in range")
    return x


def _float(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ChannelError("expected a finite number")
    return float(x)


def _bool(x: Any) -> bool:
    if not isinstance(x, bool):
        raise ChannelError("expected a boolean")
    return x


def _list(x: Any, cap: int = MAX_LIST) -> list[Any]:
    if not isinstance(x, list) or len(x) > cap:
        raise ChannelError("expected a list")
    return x


def _args(x: Any, n: int) -> list[Any]:
    if not isinstance(x, list) or len(x) != n:
        raise ChannelError(f"expected {n} arguments")
    return x


# -- sampling parameters: one checker per field annotation -----------------------------------
_I64 = 1 << 63
_FIELD_CHECKS: dict[str, Any] = {
    "int": lambda x: _int(x, -_I64, _I64 - 1),
    "float": _float,
    "bool": _bool,
    "int | None": lambda x: None if x is None else _int(x, -_I64, _I64 - 1),
    "tuple[str, ...]": lambda x: tuple(_str(s, MAX_STOP_CHARS) for s in _list(x)),
    "tuple[int, ...]": lambda x: tuple(_int(t, -_I64, _I64 - 1) for t in _list(x)),
    "Constraint | None": lambda x: None if x is None else _constraint(x),
}


def _constraint(x: Any) -> Constraint:
    kind, spec = _args(x, 2)
    try:
        return Constraint(ConstraintKind(_str(kind, 16)), _str(spec, MAX_SPEC_BYTES))
    except ValueError:
        raise ChannelError("unknown constraint kind") from None


# A seed is the one field wider than int64: any of the 64-bit values the API takes, of either sign.
_NAMED_CHECKS: dict[str, Any] = {"seed": lambda x: None if x is None else _int(x, SEED_MIN, SEED_MAX)}
_PARAM_FIELDS = [
    (f.name, _NAMED_CHECKS.get(f.name) or _FIELD_CHECKS[str(f.type)])
    for f in dataclasses.fields(SamplingParams)
]


def _encode_value(v: Any) -> Any:
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, Constraint):
        return [v.kind.value, v.spec]
    return v


def _encode_params(p: SamplingParams) -> list[Any]:
    return [_encode_value(getattr(p, name)) for name, _ in _PARAM_FIELDS]


def _decode_params(x: Any) -> SamplingParams:
    values = _args(x, len(_PARAM_FIELDS))
    return SamplingParams(**{name: check(v) for (name, check), v in zip(_PARAM_FIELDS, values, strict=True)})


def _encode_work(w: WorkItem) -> list[Any]:
    return [
        w.request_id,
        list(w.prompt_token_ids),
        _encode_params(w.params),
        w.priority,
        list(w.output_token_ids),
    ]


def _token_ids(x: Any) -> tuple[int, ...]:
    return tuple(_int(t, 0, (1 << 31) - 1) for t in _list(x, MAX_TOKENS))


def _decode_work(x: Any) -> WorkItem:
    rid, prompt, params, priority, output = _args(x, 5)
    priority = _int(priority, -_I64, _I64 - 1)
    return WorkItem(_id(rid), _token_ids(prompt), _decode_params(params), priority, _token_ids(output))


def _encode_target(t: KVTarget) -> list[Any]:
    return [t.transfer_id, t.address, list(t.offers), list(t.blocks), list(t.ranks)]


def _decode_target(x: Any) -> KVTarget:
    tid, address, offers, blocks, ranks = _args(x, 5)
    return KVTarget(
        _id(tid),
        _str(address),
        tuple(_str(o, 64) for o in _list(offers, 16)),
        tuple(_int(b, 0, (1 << 31) - 1) for b in _list(blocks, MAX_TOKENS)),
        tuple(_str(r) for r in _list(ranks, MAX_TP)),
    )


# -- commands --------------------------------------------------------------------------------
_CODECS: dict[str, tuple[type, Any, Any]] = {
    "prefill": (
        Prefill,
        lambda c: [_encode_work(c.work), None if c.target is None else _encode_target(c.target)],
        lambda a: Prefill(_decode_work(a[0]), None if a[1] is None else _decode_target(a[1])),
    ),
    "set_target": (
        SetTarget,
        lambda c: [c.request_id, _encode_target(c.target)],
        lambda a: SetTarget(_id(a[0]), _decode_target(a[1])),
    ),
    "withdraw": (Withdraw, lambda c: [c.request_id], lambda a: Withdraw(_id(a[0]))),
    "queue_reservation": (
        QueueReservation,
        lambda c: [_encode_work(c.work), c.transfer_id, float(c.timeout_s), c.source_ranks],
        lambda a: QueueReservation(_decode_work(a[0]), _id(a[1]), _float(a[2]), _int(a[3], 1, MAX_TP)),
    ),
    "await_reservation": (AwaitReservation, lambda c: [c.request_id], lambda a: AwaitReservation(_id(a[0]))),
    "start": (
        Start,
        lambda c: [c.request_id, c.first_token, c.cached_tokens],
        lambda a: Start(_id(a[0]), _int(a[1], 0, (1 << 31) - 1), _int(a[2])),
    ),
    "kv_lost": (KvLost, lambda c: [c.request_id], lambda a: KvLost(_id(a[0]))),
    "add_local": (AddLocal, lambda c: [_encode_work(c.work)], lambda a: AddLocal(_decode_work(a[0]))),
    "abort": (Abort, lambda c: [c.request_id], lambda a: Abort(_id(a[0]))),
    "release": (Release, lambda c: [], lambda a: Release()),
}
_ARITY = {kind: len(dataclasses.fields(cls)) for kind, (cls, _, _) in _CODECS.items()}
_KIND_OF = {cls: kind for kind, (cls, _, _) in _CODECS.items()}


def encode_command(call_id: int, cmd: Command) -> bytes:
    kind = _KIND_OF[type(cmd)]
    return frame({"v": VERSION, "c": call_id, "k": kind, "a": _CODECS[kind][1](cmd)})


def decode_command(body: bytes) -> tuple[int, Command]:
    """(call id, command), or ``ChannelError`` naming what is wrong (the call id, if readable,
    is in ``ChannelError.call_id`` so the worker can answer the caller)."""
    msg = unpack(body, MAX_COMMAND_BYTES)
    if not isinstance(msg, dict) or set(msg) != {"v", "c", "k", "a"} or msg["v"] != VERSION:
        raise ChannelError("bad command frame")
    call_id = _int(msg["c"])
    try:
        kind = msg["k"]
        if not isinstance(kind, str) or kind not in _CODECS:
            raise ChannelError(f"unknown command (a {type(kind).__name__})")
        return call_id, _CODECS[kind][2](_args(msg["a"], _ARITY[kind]))
    except ChannelError as e:
        raise CommandFrameError(call_id, str(e)) from None
    except Exception as e:  # a dataclass refused its arguments; anything else, as malformed
        raise CommandFrameError(call_id, f"bad arguments: {type(e).__name__}") from None


class CommandFrameError(ChannelError):
    """A command frame whose call id could be read but whose command could not."""

    def __init__(self, call_id: int, message: str) -> None:
        super().__init__(message)
        self.call_id = call_id


# -- answers ---------------------------------------------------------------------------------
def encode_answer(call_id: int, value: Answer) -> bytes:
    x = _encode_target(value) if isinstance(value, KVTarget) else value
    return frame({"v": VERSION, "r": call_id, "ok": True, "x": x})


def encode_error(call_id: int, err: CommandError) -> bytes:
    msg = err.message[:MAX_MESSAGE_CHARS]
    return frame({"v": VERSION, "r": call_id, "ok": False, "e": err.kind.value, "m": msg, "f": err.field})


def decode_from_worker(
    body: bytes, worker_id: str
) -> OutputBatch | WorkerInfo | tuple[int, Answer | CommandError]:
    """A frame on a worker's channel: an output batch, the worker's info
    (``pdserve.worker.info_codec``), or (call id, answer) to a command."""
    msg = unpack(body, MAX_FRAME_BYTES)
    try:
        if isinstance(msg, dict) and "r" in msg:
            return _answer(msg)
        if is_info(msg):
            return info_from(msg, worker_id)
        return batch_from(msg, worker_id)
    except ChannelError:
        raise
    except Exception as e:  # (say, an unhashable error kind): malformed, whatever it was
        raise ChannelError(f"bad frame: {type(e).__name__}") from None


def _answer(msg: dict[str, Any]) -> tuple[int, Answer | CommandError]:
    if msg.get("v") != VERSION:
        raise ChannelError("bad answer frame")
    call_id = _int(msg.get("r"))
    if msg.get("ok") is True and set(msg) == {"v", "r", "ok", "x"}:
        x = msg["x"]
        if x is None or isinstance(x, bool):
            return call_id, x
        return call_id, _decode_target(x)
    if msg.get("ok") is False and set(msg) == {"v", "r", "ok", "e", "m", "f"}:
        try:
            kind = ErrorKind(msg["e"])
        except ValueError:
            raise ChannelError("bad error kind") from None
        field = msg["f"]
        if field is not None:
            field = _str(field, 64)
        return call_id, CommandError(kind, _str(msg["m"], MAX_MESSAGE_CHARS), field)
    raise ChannelError("bad answer frame")
