"""Scattered block copies between two CPU caches, split across a few threads.

Why not ``torch`` here: a CPU ``copy_`` of one 12-layer block (hundreds of KiB) opens its own
OpenMP parallel region, so copying 128 scattered blocks means 128 fork/joins of a team. From a
transport thread, beside the engine thread's own OpenMP team, those fork/joins contend for the
same cores: scattered blocks move at a fraction of one plain copy's speed (``BENCHMARKS.md``,
KV transfer). ``numpy.copyto``
releases the GIL and uses no thread team, so a fixed pool of plain threads, each taking the
next block until none is left, runs at the memcpy ceiling without touching the process-wide
torch thread settings (which ``torch.set_num_threads`` from another thread would change).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

MIN_SPLIT_BYTES = 1 << 20  # below this a copy is not worth handing to another thread
# Pieces per thread when cutting up large runs: the last piece taken bounds how long one thread
# copies alone at the end.
PIECES_PER_THREAD = 16


class BlockCopier:
    """Copies lists of (destination, source) array pairs with ``threads`` workers.

    Contract: the caller owns both arrays and keeps them alive and unmodified by others until
    ``copy`` returns; ``copy`` returns only when every byte is written (or raises).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, min(threads or (os.cpu_count() or 1), 4))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # every peer's pusher thread copies through this

    def copy(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        total = sum(d.nbytes for d, _ in pairs)
        if self.threads == 1 or total < MIN_SPLIT_BYTES:
            _run(pairs)
            return
        if len(pairs) < PIECES_PER_THREAD * self.threads:  # few large pieces (runs): cut them up
            per = -(-PIECES_PER_THREAD * self.threads // len(pairs))
            pairs = [piece for d, s in pairs for piece in _split(d, s, per)]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kv-copy")
            pool = self._pool
        # Every thread takes the next piece from one shared iterator (a list iterator's next is
        # atomic under the GIL): a helper thread that wakes late (a busy host) simply copies
        # fewer pieces instead of finishing last with a fixed share.
        work = iter(pairs)
        futures = [pool.submit(_run, work) for _ in range(self.threads - 1)]
        try:
            _run(work)  # the calling thread copies too
        finally:
            # Every helper has stopped writing before this returns or raises (the contract):
            # wait for all of them first, then surface the first failure.
            wait(futures)
        for f in futures:
            f.result()

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _run(pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def _split(dst: np.ndarray, src: np.ndarray, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Up to ``n`` pieces: contiguous ranges along the second axis (blocks of a [layers, blocks,
    bytes] run, where in a block-major cache a range of blocks is one run of memory; bytes of a
    [layers, bytes] block) or, when it has length 1, along the first."""
    axis = 1 if dst.ndim >= 2 and dst.shape[1] > 1 else 0
    size = dst.shape[axis]
    k = min(n, size)
    index: list[slice] = [slice(None)] * dst.ndim
    pieces = []
    for i in range(k):
        index[axis] = slice(i * size // k, (i + 1) * size // k)
        pieces.append((dst[tuple(index)], src[tuple(index)]))
    return pieces
