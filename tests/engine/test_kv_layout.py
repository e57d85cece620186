"""The KV cache's storage order: indexed [layers, blocks, ...], stored block-major."""

from __future__ import annotations

import pytest
import torch

from pdserve.model_runtime.kv_cache.tensors import (
    BLOCK_MAJOR,
    LAYER_MAJOR,
    KVLayout,
    block_major_view,
    new_kv_cache,
    storage_order,
)

SHAPE = (3, 5, 2, 4, 2, 8)


def test_new_cache_is_block_major_and_blocks_are_contiguous_across_layers() -> None:
    cache = new_kv_cache(SHAPE, torch.float32)
    assert cache.shape == SHAPE
    assert storage_order(cache) == BLOCK_MAJOR
    assert KVLayout.of_cache(cache).order == BLOCK_MAJOR
    assert bool((cache == 0).all())
    for b in range(SHAPE[1]):
        assert cache[:, b].is_contiguous()  # a block's every layer: one piece to copy
        assert cache[1, b].is_contiguous()
    # Writing through [layer, block] lands where the block-major storage puts it.
    cache[2, 4, 1, 3, 1, 7] = 1.0
    flat = cache.transpose(0, 1).reshape(-1)
    per_block = 2 * 4 * 2 * 8
    assert flat[(4 * SHAPE[0] + 2) * per_block + per_block - 1] == 1.0


def test_block_major_view_round_trips_and_orders_are_told_apart() -> None:
    data = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32)
    view = block_major_view(data, SHAPE)
    assert storage_order(view) == BLOCK_MAJOR
    assert view.data_ptr() == data.data_ptr()
    assert storage_order(torch.zeros(SHAPE)) == LAYER_MAJOR
    assert KVLayout.of_cache(torch.zeros(SHAPE)) != KVLayout.of_cache(view)
    with pytest.raises(ValueError, match="neither block-major nor layer-major"):
        storage_order(torch.zeros(SHAPE)[:, 1:])
    with pytest.raises(ValueError, match="neither"):
        storage_order(new_kv_cache((3, 5, 2, 4, 2, 16), torch.float32)[..., :8])
