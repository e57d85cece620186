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
    def of(config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVLayout:
        return KVLayout(config.num_layers, block_size, config.num_kv_heads, config.head_dim, str(dtype))

    @property
    def block_elems_per_layer(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    shape = (config.num_layers, num_blocks, 2, block_size, config.num_kv_heads, config.head_dim)
    # Zero-filled so that padded reads of never-written slots are finite (they are masked anyway).
    return torch.zeros(shape, dtype=dtype, device=device)


def block_bytes(cache: torch.Tensor, layer: int, block: int) -> torch.Tensor:
    """One block of one layer as a flat contiguous view."""
    return cache[layer, block].view(-1)
