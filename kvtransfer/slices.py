"""Copying a head slice of blocks: the regions every data path moves for a sliced transfer.

A cache is [layers, blocks, 2, block_size, heads, head_dim]; heads ``[h, h + c)`` of a run of
``n`` consecutive blocks in one layer are one strided region [n, 2, block_size, c, head_dim]
(keys and values together). Every path moves a sliced transfer as one copy — one descriptor —
per (layer, contiguous run of blocks): the direct-write paths copy each region straight into the
peer's cache, the socket paths (tcp, nccl) pack the regions of a layer into one staging buffer
on the sender and scatter it on the receiver. Never one copy per token slot or per head.

Works on numpy arrays and torch tensors alike (indexing only; the caller passes the copy), all
as bytes: ``head_bytes`` views a cache as uint8 [layers, blocks, 2, block_size, heads, bytes per
head], so peers agree on sizes whatever the element type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pdserve.kvtransfer.heads import HeadSlice

A = TypeVar("A")  # a numpy array or a torch tensor


@dataclass(frozen=True)
class Moved:
    """What one push or receive of a sliced transfer did: bytes and copy operations."""

    nbytes: int
    descriptors: int


def head_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 [layers, blocks, 2, block_size, heads, bytes per head] (shares memory)."""
    return cache.view(torch.uint8)


def slice_block_nbytes(cache: torch.Tensor, count: int) -> int:
    """Bytes of ``count`` heads of one block in one layer (keys and values)."""
    _, _, kv, block_size, _, head_dim = cache.shape
    return int(kv * block_size * count * head_dim * cache.element_size())


def runs(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in ``blocks``, first block, length) of each stretch of consecutive blocks."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks):
        if out and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, b, 1))
    return out


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs where both block lists advance by one together."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def region(cache: A, layer: int, first: int, n: int, head: int, count: int) -> A:
    """Heads ``[head, head + count)`` of blocks ``[first, first + n)`` of ``layer``."""
    return cache[layer, first : first + n, :, :, head : head + count]  # type: ignore[index,no-any-return]


def direct_pairs(
    src_cache: A, dst_cache: A, layers: range, src: Sequence[int], dst: Sequence[int], heads: HeadSlice
) -> list[tuple[A, A]]:
    """(destination, source) regions for copying the slice of ``src`` into ``dst``: one per
    layer and run where both lists advance together."""
    c = heads.count
    return [
        (
            region(dst_cache, layer, d, n, heads.dst_start, c),
            region(src_cache, layer, s, n, heads.src_start, c),
        )
        for layer in layers
        for s, d, n in coalesce(src, dst)
    ]


def pack(
    cache: A, staging: A, layer: int, blocks: Sequence[int], head: int, copy: Callable[[A, A], Any]
) -> int:
    """Copy heads ``[head, head + count)`` of ``blocks`` in ``layer`` into ``staging``
    [len(blocks), 2, block_size, count, bytes per head], in list order; returns copies made."""
    count = staging.shape[3]  # type: ignore[attr-defined]
    pieces = runs(blocks)
    for i, first, n in pieces:
        copy(staging[i : i + n], region(cache, layer, first, n, head, count))  # type: ignore[index]
    return len(pieces)


def unpack(
    staging: A, cache: A, layer: int, blocks: Sequence[int], head: int, copy: Callable[[A, A], Any]
) -> int:
    """The inverse of ``pack``: scatter ``staging`` into heads ``[head, head + count)`` of
    ``blocks`` in ``layer``; returns copies made."""
    count = staging.shape[3]  # type: ignore[attr-defined]
    pieces = runs(blocks)
    for i, first, n in pieces:
        copy(region(cache, layer, first, n, head, count), staging[i : i + n])  # type: ignore[index]
    return len(pieces)
