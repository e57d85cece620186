"""Scattered block copies between two CPU caches, split across a few threads.

Why not ``torch`` here: a CPU ``copy_`` of one 12-layer block (hundreds of KiB) opens its own
OpenMP parallel region, so copying 128 scattered blocks means 128 fork/joins of a team. From a
transport thread, beside the engine thread's own OpenMP team, those fork/joins contend for the
same cores: 128 blocks moved at 5-7 GB/s where one plain copy of the same bytes ran at 20-27
(measured on the 2-core CI host, ``benchmarks/kvtransfer_bandwidth.py``). ``numpy.copyto``
releases the GIL and uses no thread team, so a fixed pool of plain threads, each copying its
share of the blocks, runs at the memcpy ceiling without touching the process-wide torch thread
settings (which ``torch.set_num_threads`` from another thread would change).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MIN_SPLIT_BYTES = 1 << 20  # below this a copy is not worth handing to another thread


class BlockCopier:
    """Copies lists of (destination, source) array pairs with ``threads`` workers.

    Contract: the caller owns both arrays and keeps them alive and unmodified by others until
    ``copy`` returns; ``copy`` returns only when every byte is written (or raises).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, min(threads or (os.cpu_count() or 1), 4))
        self._pool: ThreadPoolExecutor | None = None

    def copy(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        total = sum(d.nbytes for d, _ in pairs)
        if self.threads == 1 or total < MIN_SPLIT_BYTES:
            _run(pairs)
            return
        if len(pairs) < 4 * self.threads:  # few large pieces (runs of blocks): cut them up
            pairs = [piece for d, s in pairs for piece in _split(d, s, self.threads)]
        shares = _balance(pairs, self.threads)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kv-copy")
        futures = [self._pool.submit(_run, share) for share in shares[1:]]
        try:
            _run(shares[0])  # the calling thread takes a share too
        finally:
            for f in futures:
                f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _run(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        np.copyto(dst, src)


def _split(dst: np.ndarray, src: np.ndarray, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` pieces along the longer of the first two axes (layers, blocks)."""
    axis = 0 if dst.ndim < 2 or dst.shape[0] >= dst.shape[1] else 1
    k = min(n, dst.shape[axis])
    index = [slice(None)] * dst.ndim
    pieces = []
    for i in range(k):
        index[axis] = slice(i, None, k)
        pieces.append((dst[tuple(index)], src[tuple(index)]))
    return pieces


def _balance(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], n: int
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """``n`` shares of about equal bytes, largest pieces placed first."""
    if len({d.nbytes for d, _ in pairs}) == 1:  # whole blocks: dealing them out is balanced
        return [list(pairs[i::n]) for i in range(n)]
    shares: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
    loads = [0] * n
    for pair in sorted(pairs, key=lambda p: -p[0].nbytes):
        i = loads.index(min(loads))
        shares[i].append(pair)
        loads[i] += pair[0].nbytes
    return shares
