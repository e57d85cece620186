"""Per-request block tables on top of a ``BlockPool`` (pure Python).

Contract:
* ``get_computed_blocks`` only looks; it takes no reference.
* ``allocate_slots`` is all-or-nothing: it returns ``False`` and changes nothing when the pool
  cannot hold the request's next tokens, so a scheduler can try, then preempt or wait.
* ``free`` returns every reference the request holds; after it the request owns no block.
* A block's KV is published to the prefix cache (``cache_computed_blocks``) only once all of its
  tokens have been computed, so a prefix hit never reads a half-written block.
* Per-request state (block table, chained block keys, published count) exists exactly while the
  request holds blocks: ``get_computed_blocks`` on a request without blocks keeps nothing, and
  ``free`` drops all of it. Keys are never carried over from an earlier holder of the same id,
  whose tokens may differ (that would publish one context's KV under another's keys).
* ``retire`` ends a request's hold on its blocks while a step already launched may still write
  them (an overlapped decode step): the request's state goes, as with ``free``, but the blocks
  stay out of the pool under a handle until ``release``. The request's id is free at once for a
  new request, whose blocks are its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pdserve.model_runtime.kv_cache.block_pool import BlockKey, BlockPool, PoolStats, chain_key
from pdserve.model_runtime.request import Request


def check_idle(kv: KVCacheManager, idle: bool, request_state: Mapping[str, int]) -> None:
    """An engine's leak check: the pool is consistent, and an idle engine (no request held)
    holds no block and no per-request state (``request_state``: each map's size)."""
    stats = kv.check_integrity()
    if not idle:
        return
    if stats.used:
        raise AssertionError(f"{stats.used} KV blocks still used with no request in flight")
    left = {k: v for k, v in request_state.items() if v}
    if left:
        raise AssertionError(f"per-request state left with no request in flight: {left}")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


# The chained keys of a prompt's full blocks (``prefix_block_keys``), from whoever has them at
# hand already (a simulator replaying the same prompts point after point): a pure function of
# the prompt, so a provider changes the cost of a key, never the key.
PromptKeys = Callable[[tuple[int, ...]], Sequence[BlockKey]]
# The same for the prompt's full blocks as tuples (``Request.token_block`` of each): the prefix
# cache stores and compares whole blocks, and slicing them anew costs a copy a block an engine.
PromptBlocks = Callable[[tuple[int, ...]], Sequence[tuple[int, ...]]]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        prompt_keys: PromptKeys | None = None,
        prompt_blocks: PromptBlocks | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._prompt_keys = prompt_keys
        self._prompt_blocks = prompt_blocks
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._blocks: dict[str, list[int]] = {}
        self._keys: dict[str, list[BlockKey]] = {}
        self._num_published: dict[str, int] = {}
        # the block table as an immutable tuple, built once per change of the table: a decode
        # step hands every running request's table to the executor, and a table changes once
        # every ``block_size`` tokens
        self._views: dict[str, tuple[int, ...]] = {}
        self._retired: dict[int, list[int]] = {}  # handle -> blocks a launched step may write
        self._next_handle = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def block_table_view(self, request_id: str) -> tuple[int, ...]:
        """``block_table`` as a tuple, not rebuilt while the table is unchanged."""
        view = self._views.get(request_id)
        if view is None:
            table = self._blocks.get(request_id)
            if table is None:
                return ()
            view = self._views[request_id] = tuple(table)
        return view

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks

    def _request_keys(self, req: Request, num_full_blocks: int) -> list[BlockKey]:
        """The chained keys of ``req``'s first blocks; memoised only while it holds blocks."""
        held = req.request_id in self._blocks
        keys = self._keys.setdefault(req.request_id, []) if held else []
        if not keys and num_full_blocks and self._prompt_keys is not None:
            keys.extend(self._prompt_keys(req.prompt_token_ids))
        bs = self.block_size
        while len(keys) < num_full_blocks:
            i = len(keys)
            keys.append(chain_key(keys[-1] if keys else None, req.token_block(i * bs, (i + 1) * bs)))
        return keys

    def _known_blocks(self, req: Request) -> Sequence[tuple[int, ...]]:
        """The prompt's full blocks from the provider (empty without one)."""
        return self._prompt_blocks(req.prompt_token_ids) if self._prompt_blocks is not None else ()

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of ``req`` as (blocks, tokens); at least one token is left to compute."""
        if not self.pool.enable_prefix_caching or req.request_id in self._blocks:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        # keys up to the first miss only: a prompt no cache holds costs one key, not one a block
        known = self._prompt_keys(req.prompt_token_ids) if self._prompt_keys is not None else ()
        blocks = self._known_blocks(req)
        hits: list[int] = []
        bs = self.block_size
        key: BlockKey | None = None
        for i in range(max_blocks):
            tokens = blocks[i] if i < len(blocks) else req.token_block(i * bs, (i + 1) * bs)
            key = known[i] if i < len(known) else chain_key(key, tokens)
            block = self.pool.lookup(key, tokens)
            if block is None:
                break
            hits.append(block)
        self.pool.record_queries(req.num_tokens, len(hits) * bs)
        return hits, len(hits) * bs

    def can_allocate(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        existing = len(self._blocks.get(req.request_id, ()))
        total_tokens = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        new_blocks = max(0, blocks_needed(total_tokens, self.block_size) - existing - len(computed_blocks))
        # A hit on an unreferenced cached block takes it out of the free queue too.
        revived = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        return new_blocks + revived <= self.pool.num_free_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Reserve room for ``num_new_tokens`` beyond the computed ones; all-or-nothing.

        ``computed_blocks`` (from ``get_computed_blocks``) are prefix hits taken on first allocation;
        the caller then advances ``req.num_computed_tokens`` past them.
        """
        rid = req.request_id
        table = self._blocks.get(rid)
        if (
            table is not None
            and not computed_blocks
            and req.num_computed_tokens + num_new_tokens <= len(table) * self.block_size
        ):
            return True  # the blocks it holds have room (most decode steps): nothing changes
        if not self.can_allocate(req, num_new_tokens, computed_blocks):
            return False
        self._views.pop(rid, None)
        table = self._blocks.setdefault(rid, [])
        self._num_published.setdefault(req.request_id, 0)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            self._num_published[req.request_id] = len(table)
        total_tokens = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        missing = blocks_needed(total_tokens, self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Publish every block of ``req`` whose tokens are now all computed."""
        if not self.pool.enable_prefix_caching:
            return
        rid = req.request_id
        table = self._blocks.get(rid)
        if table is None:
            return
        n_full = min(req.num_computed_tokens // self.block_size, len(table))
        start = self._num_published.get(rid, 0)
        if n_full <= start:
            return
        keys = self._request_keys(req, n_full)
        blocks = self._known_blocks(req)
        bs = self.block_size
        for i in range(start, n_full):
            tokens = blocks[i] if i < len(blocks) else req.token_block(i * bs, (i + 1) * bs)
            self.pool.cache(table[i], keys[i], tokens)
        self._num_published[rid] = n_full

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks (tail first, so the tail is evicted first)."""
        table = self._blocks.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._num_published.pop(request_id, None)
        self._views.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def retire(self, request_id: str) -> int | None:
        """Drop the request's state but keep its blocks until ``release(handle)``; ``None``
        (nothing kept) when it held no block."""
        table = self._blocks.get(request_id)
        if not table:
            self.free(request_id)
            return None
        self._blocks.pop(request_id)
        self.free(request_id)  # the rest of its state
        handle = self._next_handle
        self._next_handle += 1
        self._retired[handle] = table
        return handle

    def release(self, handle: int) -> None:
        """Return the blocks ``retire`` kept under ``handle``."""
        table = self._retired.pop(handle)
        self.pool.free(reversed(table))

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def check_integrity(self) -> PoolStats:
        stray = (self._keys.keys() | self._num_published.keys() | self._views.keys()) - self._blocks.keys()
        if stray:
            raise AssertionError(
                f"per-request KV state kept for requests without blocks: {sorted(stray)[:5]}"
            )
        return self.pool.check_integrity([*self._blocks.values(), *self._retired.values()])

    def request_state(self) -> dict[str, int]:
        """Sizes of the per-request maps (all 0 once no request holds blocks)."""
        return {
            "kv_tables": len(self._blocks),
            "kv_keys": len(self._keys),
            "kv_published": len(self._num_published),
            "kv_views": len(self._views),
            "kv_retired": len(self._retired),
        }
