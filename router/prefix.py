"""Which worker likely holds a prompt's prefix in its KV cache (pure Python).

Prompts are cut into full KV blocks and each block gets a hash-chained key (the key of block
*i* covers blocks 0..i, so equal keys mean equal prefixes): the very keys the workers' prefix
caches use (``pdserve.model_runtime.kv_cache.block_pool.prefix_block_keys``).
The router records the keys of every prompt it sends to a worker for prefill and forgets the
oldest ones beyond that worker's cache size (an LRU estimate of the worker's own eviction): the
index is a routing hint, never a correctness input — a wrong guess costs only a recomputation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdserve.model_runtime.kv_cache.block_pool import BlockKey, prefix_block_keys


def block_keys(token_ids: Sequence[int], block_size: int) -> tuple[BlockKey, ...]:
    """Chained keys of the prompt's full blocks (a partial last block is never shared)."""
    return tuple(prefix_block_keys(token_ids, block_size))


class PrefixIndex:
    """Per-worker LRU sets of block keys, each capped at the worker's KV capacity in blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._held: dict[str, OrderedDict[BlockKey, None]] = {}
        self._capacity: dict[str, int] = {}

    def set_capacity(self, worker_id: str, blocks: int) -> None:
        self._capacity[worker_id] = max(0, blocks)
        self._trim(worker_id)

    def record(self, worker_id: str, keys: Sequence[BlockKey]) -> None:
        held = self._held.setdefault(worker_id, OrderedDict())
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        self._trim(worker_id)

    def cached_blocks(self, worker_id: str, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of ``keys`` the worker is believed to hold."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)

    def _trim(self, worker_id: str) -> None:
        held = self._held.get(worker_id)
        cap = self._capacity.get(worker_id)
        if held is None or cap is None:
            return
        while len(held) > cap:
            held.popitem(last=False)
