"""Control frames: length-prefixed msgpack maps, bounded and schema-checked (pure Python).

Frame = 4-byte big-endian length, then a msgpack map ``{"v": VERSION, "t": TYPE, ...}``.
Decoding never executes or instantiates anything: no pickle, no msgpack ext types, maps with
string keys only, a cap on frame size, string/array lengths and nesting depth, then an exact
schema per frame type (unknown fields and wrong types are errors). A raw payload may follow a
``data`` frame; its size comes from validated header fields, never from the peer's say-so alone.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]

from pdserve.kvtransfer.heads import MAX_KV_HEADS

VERSION = 1
# Features a receiver offers in its ``welcome`` info (``"features": [...]``); a sender uses one
# only when offered (an older receiver refuses frames with fields it does not know).
END_FLAG = "end_flag"  # ``done`` on the last ``data`` / ``layer`` frame instead of a ``done`` frame
HEAD_SLICE = "head_slice"  # ``begin`` and ``data`` frames may carry ``heads`` (``kvtransfer.heads``)
LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 20  # control frames carry block lists and handles, nothing bulky
MAX_DEPTH = 6
MAX_LIST = 1 << 16
MAX_STR = 4096
MAX_ID_LEN = 256


class FrameError(ValueError):
    """The bytes are not a valid frame; the connection that produced them must be dropped."""


def _ext_rejected(code: int, data: bytes) -> Any:
    raise FrameError(f"msgpack extension type {code} is not allowed")


# Field specs: a type, or ("list", item_type[, max_len]).
_ID = str
_UINT = int
_BLOCKS = ("list", int)
_HEADS = ("list", int, 3)  # a head slice: [src_start, dst_start, count]
_SCHEMAS: dict[str, dict[str, Any]] = {
    # connection set-up: server challenge, client hello, server welcome or refuse
    "challenge": {"nonce": bytes},
    "hello": {"mac": bytes, "nonce": bytes, "layout": dict, "backend": str, "pid": _UINT, "info": dict},
    "welcome": {"mac": bytes, "backend": str, "info": dict},
    "refuse": {"reason": str, "cause": str},
    # sender -> receiver
    # heads: only the slice of each block's KV heads moves (peers whose head counts differ)
    "begin": {"id": _ID, "dst_blocks": _BLOCKS, "num_layers": _UINT, "layerwise": bool, "heads": _HEADS},
    # + raw payload (tcp, nccl); done: this frame ends the transfer (no separate ``done``);
    # heads: the payload holds that many heads of each block (a sliced transfer's count)
    "data": {"id": _ID, "layer": _UINT, "first": _UINT, "count": _UINT, "done": bool, "heads": _UINT},
    "layer": {"id": _ID, "layer": _UINT, "count": _UINT, "done": bool},  # [layer, layer+count) written
    "done": {"id": _ID},
    "aborted": {"id": _ID},  # the sender stopped writing this transfer (answers "abort")
    # receiver -> sender
    "ready": {"id": _ID, "write_until_ns": _UINT},  # direct-write paths: the lease's end (monotonic)
    "reject": {"id": _ID, "reason": str, "cause": str},
    # either direction: give up on a transfer
    "abort": {"id": _ID, "reason": str},
}
_OPTIONAL: dict[str, set[str]] = {
    "hello": {"info"},
    "ready": {"write_until_ns"},
    "data": {"done", "heads"},
    "begin": {"heads"},
    "layer": {"done"},
}


def encode(frame_type: str, **fields: Any) -> bytes:
    """One frame as bytes, length prefix included. Validates like the decoder does."""
    msg = {"v": VERSION, "t": frame_type, **fields}
    validate(msg)
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return LENGTH.pack(len(body)) + body


def check_length(n: int, limit: int = MAX_FRAME_BYTES) -> int:
    if n <= 0 or n > limit:
        raise FrameError(f"frame length {n} outside 1..{limit}")
    return n


def decode_body(body: bytes) -> dict[str, Any]:
    """Decode and validate one frame body (without its length prefix)."""
    check_length(len(body))
    try:
        msg = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_ext_rejected,
            max_str_len=MAX_STR,
            max_bin_len=MAX_FRAME_BYTES,
            max_array_len=MAX_LIST,
            max_map_len=64,
            max_ext_len=0,
        )
    except FrameError:
        raise
    except Exception as e:  # msgpack raises ExtraData, StackError, ValueError, TypeError, ...
        raise FrameError(f"undecodable frame: {type(e).__name__}: {e}") from None
    validate(msg)
    return msg  # type: ignore[no-any-return]


def _depth(obj: Any) -> int:
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            return d
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return deepest


def _check_value(name: str, spec: Any, value: Any) -> None:
    if isinstance(spec, tuple) and spec and spec[0] == "list":
        if not isinstance(value, list) or len(value) > (spec[2] if len(spec) > 2 else MAX_LIST):
            raise FrameError(f"field {name!r}: expected a list")
        for item in value:
            _check_value(name, spec[1], item)
        return
    if spec is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise FrameError(f"field {name!r}: expected a non-negative integer, got {type(value).__name__}")
    if spec is int:
        return
    if not isinstance(value, spec):
        raise FrameError(f"field {name!r}: expected {spec.__name__}, got {type(value).__name__}")
    if spec is str and name == "id" and not 0 < len(value) <= MAX_ID_LEN:
        raise FrameError("field 'id': must be 1..256 characters")


def validate(msg: Any) -> None:
    if not isinstance(msg, dict):
        raise FrameError(f"frame must be a map, got {type(msg).__name__}")
    if _depth(msg) > MAX_DEPTH:
        raise FrameError(f"frame nesting deeper than {MAX_DEPTH}")
    if msg.get("v") != VERSION:
        raise FrameError(f"unsupported frame version {msg.get('v')!r} (expected {VERSION})")
    ftype = msg.get("t")
    if not isinstance(ftype, str) or ftype not in _SCHEMAS:
        raise FrameError(f"unknown frame type {ftype!r}")
    schema = _SCHEMAS[ftype]
    optional = _OPTIONAL.get(ftype, set())
    extra = set(msg) - set(schema) - {"v", "t"}
    if extra:
        raise FrameError(f"{ftype}: unexpected field(s) {sorted(extra)}")
    for name, spec in schema.items():
        if name not in msg:
            if name in optional:
                continue
            raise FrameError(f"{ftype}: missing field {name!r}")
        _check_value(name, spec, msg[name])
    if "heads" in msg:
        _check_heads(ftype, msg["heads"])


def _check_heads(ftype: str, heads: Any) -> None:
    """A head slice names 1..``MAX_KV_HEADS`` heads of caches of at most ``MAX_KV_HEADS``
    (whether they fit the two caches is the receiver's check: it knows both head counts)."""
    if ftype == "begin" and len(heads) != 3:
        raise FrameError("begin: heads must be [src_start, dst_start, count]")
    src, dst, count = heads if ftype == "begin" else (0, 0, heads)
    if count < 1 or max(src, dst) + count > MAX_KV_HEADS:
        raise FrameError(f"{ftype}: head slice {heads} outside 1..{MAX_KV_HEADS} heads")
