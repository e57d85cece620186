"""The KV cache memory: one tensor [layers, blocks, 2, block_size, kv_heads, head_dim].

Indexing ``cache[layer, block]`` yields that block's keys and values for one layer as one
contiguous run of bytes, which is what the transfer layer ships.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runtime.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    """What two workers must agree on before exchanging blocks."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @staticmethod
    def of_cache(cache: torch.Tensor) -> KVLayout:
        """The layout of a cache allocated by ``allocate_kv_cache``."""
        if cache.dim() != 6 or cache.shape[2] != 2:
            raise ValueError(
                f"expected a KV cache [layers, blocks, 2, block, heads, dim], got {tuple(cache.shape)}"
            )
        layers, _, _, block, heads, dim = cache.shape
        return KVLayout(layers, block, heads, dim, str(cache.dtype))


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (config.num_layers, num_blocks, 2, block_size, config.num_kv_heads, config.head_dim)


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    shape = kv_cache_shape(config, num_blocks, block_size)
    # Zero-filled so that padded reads of never-written slots are finite (they are masked anyway).
    return torch.zeros(shape, dtype=dtype, device=device)
