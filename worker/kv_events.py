"""A worker's prefix-cache events, kept for its routers (pure Python, thread-safe).

The engine's thread publishes and evicts keys (``BlockPool.listen`` calls ``stored`` /
``removed``); the channel's thread takes what changed since its last take (``take``) and, for a
new connection, the whole cached set (``snapshot``). Routers build their view of every
worker's cache from these alone, so router replicas agree and a restarted one knows at once
what the workers hold.

A role switch keeps the pool, but the routers drop their view of a worker when it leaves its
pool: ``resync`` makes the next take a snapshot.

Bounds: the log keeps at most ``max_ops`` ops. Past that nobody has been taking them (no
channel yet, or none for long), and a snapshot is smaller than the ops (``max_ops`` is about
twice the pool's blocks): the ops are dropped and the next take is a snapshot instead. A
snapshot carries at most ``MAX_SNAPSHOT_KEYS`` keys (the newest published), so one frame stays
well under the channel's frame limit; a pool caching more blocks than that (none we serve)
leaves its oldest keys out of its routers' view, which costs those prefixes a recomputation,
never a wrong answer.
"""

from __future__ import annotations

import itertools
import threading

from pdserve.model_runtime.kv_cache.block_pool import BlockKey
from pdserve.worker.messages import KvEvents

# Per frame, so ops and a snapshot together (a new connection's first batch) stay near 30 MB
# of the channel's 64 MiB frames (an op is 20 bytes of msgpack, a snapshot's key 18).
MAX_KV_OPS = 1 << 19
MAX_SNAPSHOT_KEYS = 1 << 20
MIN_LOG_OPS = 4096  # the log's bound for tiny pools: a few steps' worth


class KvEventLog:
    """Ops in order since the last ``take``, and the cached key set they lead to."""

    def __init__(self, num_blocks: int) -> None:
        self.max_ops = min(MAX_KV_OPS, max(MIN_LOG_OPS, 2 * num_blocks))
        self._lock = threading.Lock()
        self._ops: list[tuple[bool, BlockKey]] = []
        # The cached set, in publication order (a key is published again only after removal):
        # the pool's own index is the engine thread's alone, so snapshots read this copy.
        self._held: dict[BlockKey, None] = {}
        self._snapshot_due = False  # the ops were dropped: the next take is a snapshot
        self.overflows = 0  # times the ops were dropped for a snapshot

    # -- the engine's thread (``KeyListener``) ---------------------------------------------------
    def stored(self, key: BlockKey) -> None:
        with self._lock:
            self._held[key] = None
            if not self._snapshot_due:  # (else the next take is a snapshot, with this op in it)
                self._ops.append((True, key))
                if len(self._ops) > self.max_ops:
                    self._snapshot_next()
                    self.overflows += 1

    def removed(self, key: BlockKey) -> None:
        with self._lock:
            self._held.pop(key, None)
            if not self._snapshot_due:
                self._ops.append((False, key))
                if len(self._ops) > self.max_ops:
                    self._snapshot_next()
                    self.overflows += 1

    def _snapshot_next(self) -> None:
        self._ops = []
        self._snapshot_due = True

    def resync(self) -> None:
        """Make the next take a snapshot (the routers dropped their view of this worker)."""
        with self._lock:
            self._snapshot_next()

    # -- the channel's thread --------------------------------------------------------------------
    def take(self) -> KvEvents | None:
        """The ops since the last take, in order (a snapshot instead if they overflowed or
        ``resync`` asked for one); ``None`` when nothing changed."""
        with self._lock:
            if self._snapshot_due:
                self._snapshot_due = False
                return KvEvents((), self._snapshot())
            if not self._ops:
                return None
            ops, self._ops = self._ops, []
        return KvEvents(tuple(ops))

    def snapshot(self) -> KvEvents:
        """The whole cached set now (it reflects every op made so far, taken or not)."""
        with self._lock:
            return KvEvents((), self._snapshot())

    def _snapshot(self) -> tuple[BlockKey, ...]:
        held = self._held
        skip = len(held) - MAX_SNAPSHOT_KEYS
        if skip <= 0:
            return tuple(held)
        return tuple(itertools.islice(held, skip, None))
