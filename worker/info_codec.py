"""A worker's identity on its worker channel (pure Python): the ``info`` frame.

Right after the handshake, a worker sends its ``WorkerInfo`` as the channel's first frame,
``{"v", "i": [field...]}`` with the fields in ``WorkerInfo``'s order, and sends it again
whenever it changes (a role switch). A router replica that did not start the worker learns
from it what the pool owner learns from the worker's process (``GetInfo``); the owner checks
it against what it knows. Strictly validated: every field's type and range, nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.worker.codec import VERSION, ChannelError, frame
from pdserve.worker.messages import WorkerInfo, WorkerRole

MAX_TEXT = 4096  # paths and names in an info frame

_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerInfo))
_TEXT = {"worker_id", "address", "model_dir", "architecture", "dtype", "node"}
_FLAGS = {"has_tokenizer"}


def encode_info(info: WorkerInfo) -> bytes:
    return frame({"v": VERSION, "i": [_wire(getattr(info, name)) for name in _FIELDS]})


def _wire(value: Any) -> Any:
    return value.value if isinstance(value, WorkerRole) else value


def is_info(msg: Any) -> bool:
    return isinstance(msg, dict) and "i" in msg


def info_from(msg: Any, worker_id: str) -> WorkerInfo:
    """The info in an unpacked frame from ``worker_id`` (the id it authenticated as);
    ``ChannelError`` unless every field is well formed and the id is its own."""
    if not isinstance(msg, dict) or set(msg) != {"v", "i"} or msg["v"] != VERSION:
        raise ChannelError("bad info frame")
    values = msg["i"]
    if not isinstance(values, list) or len(values) != len(_FIELDS):
        raise ChannelError("bad info frame")
    kwargs: dict[str, Any] = {}
    for name, value in zip(_FIELDS, values, strict=True):
        kwargs[name] = _field(name, value)
    if kwargs["worker_id"] != worker_id:
        raise ChannelError(f"info frame names {kwargs['worker_id']!r}, not the worker that sent it")
    return WorkerInfo(**kwargs)


def _field(name: str, value: Any) -> Any:
    if name == "role":
        try:
            return WorkerRole(value)
        except ValueError:
            raise ChannelError("bad role in info frame") from None
    if name in _TEXT:
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise ChannelError(f"bad {name} in info frame")
        return value
    if name in _FLAGS:
        if not isinstance(value, bool):
            raise ChannelError(f"bad {name} in info frame")
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 62:
        raise ChannelError(f"bad {name} in info frame")
    return value
