"""Caches, pools and peers for transfer tests (also imported by spawned child processes)."""

from __future__ import annotations

import random
import socket
from typing import Any

import torch

from pdserve.kvtransfer.channel import Connection, client_handshake
from pdserve.kvtransfer.config import TransportConfig
from pdserve.kvtransfer.datapath import allocate_shared_kv_cache
from pdserve.kvtransfer.tls import InternalTls
from pdserve.kvtransfer.transport import KVTransport, layout_of
from pdserve.model_runtime.kv_cache.block_pool import BlockPool
from pdserve.model_runtime.kv_cache.tensors import new_kv_cache

SECRET = b"test-secret-0123456789"
SHAPE = (6, 48, 2, 16, 2, 8)  # layers, blocks, K/V, block size, kv heads, head dim


def cache(
    seed: int | None = None, shared: bool = False, shape: tuple[int, ...] = SHAPE
) -> tuple[torch.Tensor, Any]:
    if shared:
        t, path = allocate_shared_kv_cache(shape, torch.float32)
    else:
        t, path = new_kv_cache(shape, torch.float32), None
    if seed is not None:
        t.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    return t, path


def transport(
    backend: str,
    seed: int | None = None,
    shape: tuple[int, ...] = SHAPE,
    tls: InternalTls | None = None,
    **cfg: Any,
) -> KVTransport:
    c, path = cache(seed, shared=backend == "shm", shape=shape)
    return KVTransport(c, SECRET, TransportConfig(backend=backend, **cfg), shm_path=path, tls=tls)


def pick(pool: BlockPool, n: int, rng: random.Random) -> list[int]:
    """``n`` blocks from the pool, in a random order (tests permutations on both sides)."""
    blocks = pool.allocate(n)
    rng.shuffle(blocks)
    return blocks


def same_bytes(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int]) -> bool:
    return all(torch.equal(src[:, s], dst[:, d]) for s, d in zip(src_blocks, dst_blocks, strict=True))


def raw_client(
    address: str,
    secret: bytes = SECRET,
    layout: dict[str, Any] | None = None,
    backend: str = "tcp",
    io_timeout_s: float = 2.0,
) -> Connection:
    """An authenticated connection that lets a test write arbitrary frames and bytes."""
    host, _, port = address.rpartition(":")
    conn = Connection(socket.create_connection((host, int(port)), timeout=2), io_timeout_s, address)
    client_handshake(conn, secret, layout or layout_of(new_kv_cache(SHAPE, torch.float32)), backend)
    return conn
