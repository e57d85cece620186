"""A fixed pool of KV blocks with reference counts and a hash-chained prefix cache (pure Python).

Every block is in exactly one of three states::

    FREE   (ref 0, no key)   --allocate-->  USED (ref >= 1)
    CACHED (ref 0, has key)  --allocate-->  USED            (evicts the key; LRU order)
    CACHED                   --touch----->  USED            (prefix hit, key kept)
    USED                     --free------>  FREE or CACHED  (when the last reference goes)

Free and cached blocks share one LRU queue: a block freed most recently is reused last, so
cached prefixes survive as long as possible. Keys are chained: a block's key hashes its parent's
key and its own token ids, so equal keys mean equal whole prefixes; a hit still compares the
stored token ids so that a hash collision can never serve wrong KV.

Whoever needs to know which keys the cache holds (a worker tells its routers) listens
(``listen``): it hears every key published (``stored``) and every key dropped (``removed``:
evicted by ``allocate``, or ``reset_prefix_cache``), in the order they happen.

Contract: the pool never frees on its own; whoever took a reference (``allocate`` / ``touch``)
returns it with ``free``. ``check_integrity`` verifies free + cached + used == total and, given the
owners' block lists, that every reference count equals the number of owners holding the block.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

BlockKey = bytes
KEY_BYTES = 16  # a key's length: ``chain_key``'s digest

_ROOT_KEY = b""


def chain_key(parent: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
    """Key of a full block: stable across processes (the router computes the same keys)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(parent if parent is not None else _ROOT_KEY)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def prefix_block_keys(token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """Chained keys of every full block of ``token_ids``."""
    keys: list[BlockKey] = []
    parent: BlockKey | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


class KeyListener(Protocol):
    """Hears the prefix cache's keys come and go (``BlockPool.listen``); called on the pool's
    thread, inside its transitions, so it must be cheap."""

    def stored(self, key: BlockKey) -> None: ...

    def removed(self, key: BlockKey) -> None: ...


class IntegrityError(AssertionError):
    """The pool's bookkeeping is inconsistent: a bug, never a user error."""


@dataclass(frozen=True)
class PoolStats:
    total: int
    free: int  # ref 0 without a cached key
    cached: int  # ref 0 with a key (reusable and evictable)
    used: int  # ref >= 1

    @property
    def usage(self) -> float:
        return self.used / self.total if self.total else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._by_key: dict[BlockKey, int] = {}
        # Insertion order is LRU order: popitem(last=False) takes the least recently freed block.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_free = 0  # blocks in the free queue that still hold a key (stats in O(1))
        self.num_evictions = 0
        self.num_queries = 0
        self.num_hits = 0
        self._listener: KeyListener | None = None

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (free and cached-but-unreferenced)."""
        return len(self._free_queue)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def lookup(self, key: BlockKey, token_ids: Sequence[int]) -> int | None:
        """The cached block for ``key`` whose stored tokens equal ``token_ids``, if any."""
        if not self.enable_prefix_caching:
            return None
        block = self._by_key.get(key)
        if block is None or self._tokens.get(block) != tuple(token_ids):
            return None
        return block

    def record_queries(self, queried: int, hit: int) -> None:
        self.num_queries += queried
        self.num_hits += hit

    def cached_among_next(self, n: int) -> int:
        """How many of the next ``n`` blocks ``allocate`` would hand out hold a cached key
        (allocating them evicts it): what ``n`` more blocks taken do to ``stats().cached``."""
        return sum(1 for b in itertools.islice(self._free_queue, n) if self._key[b] is not None)

    def stats(self) -> PoolStats:
        cached = self._cached_free
        free = len(self._free_queue) - cached
        return PoolStats(self.num_blocks, free, cached, self.num_blocks - len(self._free_queue))

    def cached_keys(self) -> list[BlockKey]:
        """Every key the cache holds now, oldest publication first."""
        return list(self._by_key)

    def listen(self, listener: KeyListener) -> None:
        """Tell ``listener`` of every key published or dropped from now on; the keys held now
        reach it first, as ``stored``."""
        for key in self._by_key:
            listener.stored(key)
        self._listener = listener

    # -- transitions -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref 1 each), evicting the least recently used cached keys."""
        if n > len(self._free_queue):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free_queue)} free")
        out: list[int] = []
        queue, keys, refs = self._free_queue, self._key, self._ref
        for _ in range(n):
            block, _ = queue.popitem(last=False)
            if keys[block] is not None:
                self._evict_key(block)
            refs[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit keeps the block's key)."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free_queue[b]
                if self._key[b] is not None:
                    self._cached_free -= 1
            self._ref[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Return one reference per block. Pass tail blocks first so they are evicted first."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise IntegrityError(f"double free of KV block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free_queue[b] = None
                if self._key[b] is not None:
                    self._cached_free += 1

    def cache(self, block: int, key: BlockKey, token_ids: Sequence[int]) -> None:
        """Publish a full, computed block under ``key`` (first writer wins; duplicates stay private)."""
        if not self.enable_prefix_caching or self._key[block] is not None or key in self._by_key:
            return
        self._key[block] = key
        self._tokens[block] = tuple(token_ids)
        self._by_key[key] = block
        if self._ref[block] == 0:
            self._cached_free += 1
        if self._listener is not None:
            self._listener.stored(key)

    def reset_prefix_cache(self) -> None:
        for b in list(self._by_key.values()):
            self._evict_key(b)

    def _evict_key(self, block: int) -> None:
        key = self._key[block]
        if key is not None:
            if self._ref[block] == 0:
                self._cached_free -= 1
            del self._by_key[key]
            del self._tokens[block]
            self._key[block] = None
            self.num_evictions += 1
            if self._listener is not None:
                self._listener.removed(key)

    # -- invariants --------------------------------------------------------------------------
    def check_integrity(
        self, owners: Mapping[str, Sequence[int]] | Iterable[Sequence[int]] | None = None
    ) -> PoolStats:
        """Raise ``IntegrityError`` on any inconsistency; return the stats it verified.

        ``owners`` maps each holder (request id) to the blocks it references (or lists them, one
        sequence per holder); when given, every block's reference count must equal how many
        times owners list it.
        """
        stats = self.stats()
        recount = sum(1 for b in self._free_queue if self._key[b] is not None)
        if recount != self._cached_free:
            raise IntegrityError(f"cached-free counter {self._cached_free} != {recount}")
        if stats.free + stats.cached + stats.used != self.num_blocks:
            raise IntegrityError(f"free+cached+used != total: {stats}")
        for b in range(self.num_blocks):
            in_queue = b in self._free_queue
            if (self._ref[b] == 0) != in_queue:
                raise IntegrityError(f"block {b}: ref {self._ref[b]} but in free queue={in_queue}")
            if self._ref[b] < 0:
                raise IntegrityError(f"block {b}: negative ref {self._ref[b]}")
        for key, b in self._by_key.items():
            if self._key[b] != key or b not in self._tokens:
                raise IntegrityError(f"block {b}: key index out of sync")
        if sum(k is not None for k in self._key) != len(self._by_key):
            raise IntegrityError("block keys and key index differ in size")
        if owners is not None:
            counts: Counter[int] = Counter()
            for blocks in owners.values() if isinstance(owners, Mapping) else owners:
                counts.update(blocks)
            for b in range(self.num_blocks):
                if counts[b] != self._ref[b]:
                    raise IntegrityError(
                        f"block {b}: ref count {self._ref[b]} but {counts[b]} owners hold it"
                    )
        return stats
