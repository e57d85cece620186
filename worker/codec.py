"""The worker -> router output channel's frames: length-prefixed msgpack, strictly validated
(pure Python). Nothing is ever unpickled; decoding builds only the frozen message types.

Connection: the router sends a 32-byte random challenge; the worker answers with a ``hello``
frame ``{"v", "worker", "mac"}`` where ``mac = HMAC-SHA256(secret, b"worker" + challenge +
worker id)``; then the worker sends one ``OutputBatch`` frame per collect (a heartbeat when
idle). A frame is ``{"v", "w": worker id, "d": [delta...], "l": load}`` with each delta
``[request id, [token ids], logprobs | None, finished, finish reason | None,
stop token id | None, cached tokens, prefilled, error | None, kv lost]``, each logprob
``[token id, logprob, [[token id, logprob]...]]``, and the load's last item the work the other
router replicas placed on the worker, ``[prefills, prefill tokens, decodes, decode context,
decode remaining]``; a frame whose batch carries prefix-cache events has ``"k": [[[stored,
key]...], [key...] | None]`` too (ops, snapshot; each key ``KEY_BYTES`` long, at most
``MAX_KV_OPS`` ops and ``MAX_SNAPSHOT_KEYS`` keys).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]

from pdserve.model_runtime.kv_cache.block_pool import KEY_BYTES, BlockKey
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

VERSION = 7
LENGTH = struct.Struct(">I")
CHALLENGE_BYTES = 32
MAX_FRAME_BYTES = 64 << 20
MAX_HELLO_BYTES = 4096
MAX_FAILURE_CAUSES = 32


class ChannelError(ValueError):
    """A frame is malformed or a peer failed authentication: drop the connection."""


def mac(secret: bytes, challenge: bytes, worker_id: str) -> bytes:
    return hmac.new(secret, b"worker" + challenge + worker_id.encode(), hashlib.sha256).digest()


def frame(obj: Any) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def unpack(body: bytes, limit: int) -> Any:
    if not 0 < len(body) <= limit:
        raise ChannelError(f"frame of {len(body)} bytes outside 1..{limit}")
    try:
        return msgpack.unpackb(
            body, raw=False, strict_map_key=True, max_bin_len=limit, max_ext_len=0, ext_hook=_no_ext
        )
    except ChannelError:
        raise
    except Exception as e:  # msgpack raises several unrelated types
        raise ChannelError(f"undecodable frame: {type(e).__name__}") from None


def _no_ext(code: int, data: bytes) -> Any:
    raise ChannelError("msgpack extension types are not allowed")


def router_mac(secret: bytes, nonce: bytes, worker_id: str) -> bytes:
    return hmac.new(secret, b"router" + nonce + worker_id.encode(), hashlib.sha256).digest()


def encode_hello(worker_id: str, secret: bytes, challenge: bytes, nonce: bytes) -> bytes:
    """The worker's answer to the router's challenge, with a challenge of its own (``nonce``)."""
    return frame(
        {"v": VERSION, "worker": worker_id, "mac": mac(secret, challenge, worker_id), "nonce": nonce}
    )


def decode_hello(body: bytes, secret: bytes, challenge: bytes) -> tuple[str, bytes]:
    """(the authenticated worker id, its nonce), or ``ChannelError``."""
    msg = unpack(body, MAX_HELLO_BYTES)
    if not isinstance(msg, dict) or set(msg) != {"v", "worker", "mac", "nonce"} or msg["v"] != VERSION:
        raise ChannelError("bad hello frame")
    wid, got, nonce = msg["worker"], msg["mac"], msg["nonce"]
    if not isinstance(wid, str) or not isinstance(got, bytes) or not 0 < len(wid) <= 256:
        raise ChannelError("bad hello frame")
    if not isinstance(nonce, bytes) or len(nonce) != CHALLENGE_BYTES:
        raise ChannelError("bad hello frame")
    if not hmac.compare_digest(got, mac(secret, challenge, wid)):
        raise ChannelError(f"worker {wid!r} failed authentication")
    return wid, nonce


def encode_welcome(secret: bytes, nonce: bytes, worker_id: str) -> bytes:
    """The router's proof that it knows the secret too: a worker takes commands only after it."""
    return frame({"v": VERSION, "mac": router_mac(secret, nonce, worker_id)})


def check_welcome(body: bytes, secret: bytes, nonce: bytes, worker_id: str) -> None:
    msg = unpack(body, MAX_HELLO_BYTES)
    if not isinstance(msg, dict) or set(msg) != {"v", "mac"} or msg["v"] != VERSION:
        raise ChannelError("bad welcome frame")
    got = msg["mac"]
    if not isinstance(got, bytes) or not hmac.compare_digest(got, router_mac(secret, nonce, worker_id)):
        raise ChannelError("the router failed authentication")


def encode_batch(worker_id: str, batch: OutputBatch) -> bytes:
    ld = batch.load
    return frame(
        {
            "v": VERSION,
            "w": worker_id,
            "d": [
                [
                    d.request_id,
                    list(d.token_ids),
                    None
                    if d.logprobs is None
                    else [[p.token_id, p.logprob, [list(t) for t in p.top]] for p in d.logprobs],
                    d.finished,
                    d.finish_reason,
                    d.stop_token_id,
                    d.num_cached_tokens,
                    d.prefilled,
                    d.error,
                    d.kv_lost,
                ]
                for d in batch.deltas
            ],
            "l": [
                ld.role.value,
                ld.address,
                ld.running,
                ld.waiting,
                ld.kv_total,
                ld.kv_free,
                ld.kv_cached,
                ld.health.value,
                None
                if ld.transfers is None
                else [
                    float(ld.transfers.seconds),
                    ld.transfers.count,
                    [[c, n] for c, n in ld.transfers.failures],
                    [[b, n] for b, n in ld.transfers.by_backend],
                ],
                float(ld.busy_s),
                [
                    ld.others.prefills,
                    ld.others.prefill_tokens,
                    ld.others.decodes,
                    ld.others.decode_context,
                    ld.others.decode_remaining,
                ],
            ],
        }
        | _encode_kv(batch.kv)
    )


def _encode_kv(kv: KvEvents | None) -> dict[str, Any]:
    if kv is None:
        return {}  # most batches: nothing changed in the cache
    return {"k": [[list(op) for op in kv.ops], None if kv.snapshot is None else list(kv.snapshot)]}


def _key(x: Any) -> BlockKey:
    if not isinstance(x, bytes) or len(x) != KEY_BYTES:
        raise ChannelError("bad prefix-cache key")
    return x


def _kv(x: Any) -> KvEvents:
    if not isinstance(x, list) or len(x) != 2 or not isinstance(x[0], list) or len(x[0]) > MAX_KV_OPS:
        raise ChannelError("bad prefix-cache events")
    ops, snap = x
    if snap is not None and (not isinstance(snap, list) or len(snap) > MAX_SNAPSHOT_KEYS):
        raise ChannelError("bad prefix-cache snapshot")
    out = []
    for op in ops:
        if not isinstance(op, list) or len(op) != 2 or not isinstance(op[0], bool):
            raise ChannelError("bad prefix-cache op")
        out.append((op[0], _key(op[1])))
    return KvEvents(tuple(out), None if snap is None else tuple(_key(k) for k in snap))


def _transfers(x: Any) -> TransferCounters | None:
    if x is None:
        return None
    if not isinstance(x, list) or len(x) != 4 or not isinstance(x[0], float) or not x[0] >= 0.0:
        raise ChannelError("bad transfer counters")
    return TransferCounters(x[0], _int(x[1]), _named_counts(x[2]), _named_counts(x[3]))


def _placed(x: Any) -> PlacedWork:
    if not isinstance(x, list) or len(x) != 5:
        raise ChannelError("bad placed work")
    return PlacedWork(*(_int(v) for v in x))


def _named_counts(x: Any) -> tuple[tuple[str, int], ...]:
    """``[[name, count], ...]`` (failure causes, backends): few, short names, counts >= 0."""
    if not isinstance(x, list) or len(x) > MAX_FAILURE_CAUSES:
        raise ChannelError("bad transfer counters")
    out = []
    for item in x:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str) or len(item[0]) > 64:
            raise ChannelError("bad transfer counter entry")
        out.append((item[0], _int(item[1])))
    return tuple(out)


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ChannelError("expected a non-negative integer")
    return x


def _opt_str(x: Any) -> str | None:
    if x is not None and not isinstance(x, str):
        raise ChannelError("expected a string or nil")
    return x


def _logprob(x: Any) -> Logprob:
    if not isinstance(x, list) or len(x) != 3 or not isinstance(x[1], float) or not isinstance(x[2], list):
        raise ChannelError("bad logprob")
    top = []
    for t in x[2]:
        if not isinstance(t, list) or len(t) != 2 or not isinstance(t[1], float):
            raise ChannelError("bad top logprob")
        top.append((_int(t[0]), t[1]))
    return Logprob(_int(x[0]), x[1], tuple(top))


def _delta(x: Any) -> TokenDelta:
    if not isinstance(x, list) or len(x) != 10:
        raise ChannelError("bad delta")
    rid, ids, lps, finished, reason, stop_id, cached, prefilled, error, kv_lost = x
    if not isinstance(rid, str) or not isinstance(ids, list) or not isinstance(finished, bool):
        raise ChannelError("bad delta")
    if not isinstance(prefilled, bool) or (lps is not None and not isinstance(lps, list)):
        raise ChannelError("bad delta")
    if not isinstance(kv_lost, bool):
        raise ChannelError("bad delta")
    return TokenDelta(
        request_id=rid,
        token_ids=tuple(_int(t) for t in ids),
        logprobs=None if lps is None else tuple(_logprob(p) for p in lps),
        finished=finished,
        finish_reason=_opt_str(reason),
        stop_token_id=None if stop_id is None else _int(stop_id),
        num_cached_tokens=_int(cached),
        prefilled=prefilled,
        error=_opt_str(error),
        kv_lost=kv_lost,
    )


def decode_batch(body: bytes, worker_id: str) -> OutputBatch:
    """One output frame from ``worker_id`` (the id it authenticated as)."""
    return batch_from(unpack(body, MAX_FRAME_BYTES), worker_id)


def batch_from(msg: Any, worker_id: str) -> OutputBatch:
    """An output batch from an unpacked frame (``ChannelError`` unless exactly one)."""
    if not isinstance(msg, dict) or set(msg) - {"k"} != {"v", "w", "d", "l"} or msg["v"] != VERSION:
        raise ChannelError("bad output frame")
    if msg["w"] != worker_id or not isinstance(msg["d"], list):
        raise ChannelError("bad output frame")
    ld = msg["l"]
    if not isinstance(ld, list) or len(ld) != 11 or not isinstance(ld[1], str):
        raise ChannelError("bad load")
    busy = ld[9]
    if not isinstance(busy, float) or not 0.0 <= busy < math.inf:
        raise ChannelError("bad busy seconds")
    try:
        role, health = WorkerRole(ld[0]), WorkerHealth(ld[7])
    except ValueError:
        raise ChannelError("bad load") from None
    running, waiting, total, free, cached = (_int(v) for v in ld[2:7])
    transfers = _transfers(ld[8])
    load = WorkerLoad(
        worker_id, role, ld[1], running, waiting, total, free, cached, health, transfers, busy,
        others=_placed(ld[10]),
    )  # fmt: skip
    kv = _kv(msg["k"]) if "k" in msg else None
    return OutputBatch(tuple(_delta(d) for d in msg["d"]), load, kv)
