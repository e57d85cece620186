"""Which worker holds a prompt's prefix in its KV cache (pure Python).

Prompts are cut into full KV blocks and each block gets a hash-chained key (the key of block
*i* covers blocks 0..i, so equal keys mean equal prefixes): the very keys the workers' prefix
caches use (``pdserve.model_runtime.kv_cache.block_pool.prefix_block_keys``).

The index learns each worker's cached keys from the worker itself: every output batch carries
what its prefix cache stored and evicted since the last one, and a new connection's first
batch the whole set (``KvEvents``, ``apply``). So router replicas fed by the same workers hold
the same view, and one that restarts knows at once what is cached. On top of that a router
may keep a short hint (``record``): the keys of a prompt it just placed on a worker, which that
worker has not cached yet (a burst of prompts sharing a prefix, arriving within one prefill,
would otherwise all see no holder). A hint ends when the worker's events show the key, or
``hint_s`` after it was made. The index is a routing hint, never a correctness input: a wrong
guess costs only a recomputation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdserve.model_runtime.kv_cache.block_pool import BlockKey, prefix_block_keys
from pdserve.worker.kv_events import MAX_SNAPSHOT_KEYS
from pdserve.worker.messages import KvEvents

# How long a placed prompt's keys count as cached on its worker before the worker reports them
# (it reports them as its prefill computes them: a hint outlives that only for a prompt queued
# that long, or one that never ran). Simulated, 40P+24D on the long-prompt trace at 150 req/s:
# 2 s met 0.705 of SLOs, 10 s 0.713, 30 s the same as 10 (benchmarks/prefix_routing.py).
HINT_S = 10.0


def block_keys(token_ids: Sequence[int], block_size: int) -> tuple[BlockKey, ...]:
    """Chained keys of the prompt's full blocks (a partial last block is never shared)."""
    return tuple(prefix_block_keys(token_ids, block_size))


class PrefixIndex:
    """Per-worker sets of the block keys each worker reports cached (at most its KV capacity
    in blocks), plus this router's hints."""

    def __init__(self, block_size: int, hint_s: float = HINT_S) -> None:
        self.block_size = block_size
        self.hint_s = hint_s
        self._held: dict[str, set[BlockKey]] = {}
        self._capacity: dict[str, int] = {}
        # worker -> key -> when the hint ends, oldest first (every hint lasts ``hint_s``)
        self._hints: dict[str, OrderedDict[BlockKey, float]] = {}

    def set_capacity(self, worker_id: str, blocks: int) -> None:
        """The worker's KV blocks: it cannot cache more keys, so no view of it holds more."""
        self._capacity[worker_id] = max(0, blocks)

    def apply(self, worker_id: str, events: KvEvents) -> None:
        """What the worker's prefix cache did: its snapshot first (replacing the view), then
        its ops in order. Keys beyond the worker's capacity are ignored (a worker cannot hold
        them; it would be feeding the router's memory)."""
        cap = self._capacity.get(worker_id, MAX_SNAPSHOT_KEYS)
        snap = events.snapshot
        if snap is not None:
            held = self._held[worker_id] = set(snap[len(snap) - cap :] if len(snap) > cap else snap)
        else:
            held = self._held.setdefault(worker_id, set())
        hints = self._hints.get(worker_id)
        add, discard = held.add, held.discard
        if not hints and len(held) + len(events.ops) <= cap:  # the common case, at a step a batch
            for stored, key in events.ops:
                if stored:
                    add(key)
                else:
                    discard(key)
            return
        for stored, key in events.ops:
            if not stored:
                discard(key)
            elif len(held) < cap:
                add(key)
                if hints:
                    hints.pop(key, None)  # the worker says so itself now

    def record(self, worker_id: str, keys: Sequence[BlockKey], now: float) -> None:
        """A prompt with ``keys`` was just placed on the worker: count them as cached there
        until the worker reports them, for ``hint_s`` at most."""
        if self.hint_s <= 0:
            return
        held = self._held.get(worker_id, ())
        hints = self._hints.setdefault(worker_id, OrderedDict())
        until = now + self.hint_s
        for k in keys:
            if k not in held:
                hints[k] = until
                hints.move_to_end(k)
        self._expire(hints, now)
        cap = self._capacity.get(worker_id, MAX_SNAPSHOT_KEYS)
        while len(hints) > cap:
            hints.popitem(last=False)

    def cached_blocks(self, worker_id: str, keys: Sequence[BlockKey], now: float) -> int:
        """How many leading blocks of ``keys`` the worker holds (or, by a hint, will)."""
        held = self._held.get(worker_id, ())
        hints = self._hints.get(worker_id)
        if hints:
            self._expire(hints, now)
        n = 0
        if not hints:  # (every worker but the few this router just placed prompts on)
            for k in keys:
                if k not in held:
                    break
                n += 1
            return n
        for k in keys:
            if k not in held and k not in hints:
                break
            n += 1
        return n

    def holds(self, worker_id: str) -> frozenset[BlockKey]:
        """The keys the worker reported cached (hints aside)."""
        return frozenset(self._held.get(worker_id, ()))

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)
        self._hints.pop(worker_id, None)
        self._capacity.pop(worker_id, None)

    @staticmethod
    def _expire(hints: OrderedDict[BlockKey, float], now: float) -> None:
        while hints:
            k, until = next(iter(hints.items()))
            if until > now:
                return
            del hints[k]
