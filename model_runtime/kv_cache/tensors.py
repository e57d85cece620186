"""The KV cache memory: indexed as [layers, blocks, 2, block_size, kv_heads, head_dim], stored
block-major.

``cache[layer, block]`` is that block's keys and values for one layer, one contiguous run of
bytes; ``cache[:, block]`` — every layer of one block, what a whole-request hand-off ships — is
contiguous too, because the storage underneath is [blocks, layers, ...] and the cache is its
transposed view. Why: a layer-major store cuts a block's KV into one piece per layer (32 KiB on
the ``bench`` preset), and pieces that small copy at about 3/4 of a plain memcpy on a CPU
(below the C library's non-temporal-store threshold every store first reads its cache line);
whole blocks across layers copy at the memcpy ceiling. Attention reads one layer's blocks by
index, which works the same on either order. Peers must agree on the order (``KVLayout.order``):
a direct-write sender maps the receiver's memory with its own strides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.model_runtime.config import ModelConfig

BLOCK_MAJOR = "block-major"
LAYER_MAJOR = "layer-major"


@dataclass(frozen=True)
class KVLayout:
    """What two workers must agree on before exchanging blocks."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    order: str = BLOCK_MAJOR

    @staticmethod
    def of_cache(cache: torch.Tensor) -> KVLayout:
        """The layout of a cache [layers, blocks, 2, block, heads, dim] whose blocks are each
        contiguous, stored block-major (``allocate_kv_cache``) or layer-major."""
        if cache.dim() != 6 or cache.shape[2] != 2:
            raise ValueError(
                f"expected a KV cache [layers, blocks, 2, block, heads, dim], got {tuple(cache.shape)}"
            )
        layers, _, _, block, heads, dim = cache.shape
        return KVLayout(layers, block, heads, dim, str(cache.dtype), storage_order(cache))


def storage_order(cache: torch.Tensor) -> str:
    """``BLOCK_MAJOR`` or ``LAYER_MAJOR``; anything else (e.g. a sliced or padded view) is refused,
    as the transfer paths address blocks by these strides."""
    per_block = cache[0, 0].numel()
    inner = cache.stride()[2:]
    packed = cache[0, 0].is_contiguous() and inner == torch.empty(cache.shape[2:]).stride()
    layers, blocks = cache.shape[:2]
    if packed and cache.stride(0) == per_block and cache.stride(1) == per_block * layers:
        return BLOCK_MAJOR
    if packed and cache.stride(1) == per_block and cache.stride(0) == per_block * blocks:
        return LAYER_MAJOR
    raise ValueError(f"KV cache strides {cache.stride()} are neither block-major nor layer-major")


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (config.num_layers, num_blocks, 2, block_size, config.num_kv_heads, config.head_dim)


def block_major_view(flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The cache ``shape`` = [layers, blocks, ...] over ``flat`` storage laid out block-major."""
    layers, blocks, *rest = shape
    return flat.view(blocks, layers, *rest).transpose(0, 1)


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return new_kv_cache(kv_cache_shape(config, num_blocks, block_size), dtype, device)


def new_kv_cache(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zeroed block-major cache of ``shape`` (zeros: padded reads of never-written slots are
    finite; they are masked anyway)."""
    return block_major_view(torch.zeros(math.prod(shape), dtype=dtype, device=device), shape)
