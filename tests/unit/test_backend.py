"""The engine backend's pure decisions: which backend, which graph buckets, how many splits,
how much KV fits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.model_runtime.attention_tuning import DEFAULT, AttentionTuning, DecodeLaunch, PrefillLaunch
from pdserve.model_runtime.backend import (
    GPU_MAX_SEQS,
    GPU_STEP_TOKENS,
    Backend,
    bucket_for,
    choose_backend,
    decode_scratch_bytes,
    default_max_seqs,
    default_step_tokens,
    graph_buckets,
    kv_blocks_for_free_memory,
    step_reserve_bytes,
)
from pdserve.model_runtime.config import CPU_KV_BUDGET_BYTES, CacheConfig
from pdserve.model_runtime.presets import resolve_model


def test_backend_by_device_and_request() -> None:
    assert choose_backend("cpu", True) is Backend.TORCH
    assert choose_backend("cuda", True) is Backend.PAGED
    assert choose_backend("cuda", False) is Backend.TORCH  # no Triton: the portable path
    assert choose_backend("cpu", False, "paged") is Backend.PAGED  # the ops' references
    assert choose_backend("cuda", True, "torch") is Backend.TORCH
    assert choose_backend("cuda", True, "auto") is Backend.PAGED
    with pytest.raises(ValueError, match="needs Triton"):
        choose_backend("cuda", False, "paged")
    with pytest.raises(ValueError, match="unknown engine backend 'flash'"):
        choose_backend("cuda", True, "flash")


@given(st.integers(1, 2000))
def test_every_batch_up_to_the_cap_has_a_bucket_with_bounded_padding(max_rows: int) -> None:
    buckets = graph_buckets(max_rows)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == max_rows
    for rows in range(1, max_rows + 1):
        b = bucket_for(rows, buckets)
        assert b is not None and rows <= b
        assert b == rows or b <= 4 or b - rows < b / 3 + 1  # at most a third of padding past 4
    assert bucket_for(max_rows + 1, buckets) is None


def test_graph_buckets_refuse_a_non_positive_cap() -> None:
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_attention_tuning_names_round_trip_and_bad_settings_are_refused() -> None:
    t = AttentionTuning(8, 64, DecodeLaunch(32, 2, 4), PrefillLaunch(128, 64, 8, 2))
    assert AttentionTuning.from_names(t.decode_name, t.prefill.name) == t
    assert DEFAULT.decode_name == "s16_m256/n64w4s3" and DEFAULT.prefill.name == "m64n64w4s3"
    for bad in ("s16_m256", "s0_m256/n64w4s3", "s16_m256/n48w4s3", "s16_m256/n64w4s3 "):
        with pytest.raises(ValueError):
            AttentionTuning.from_names(bad, "m64n64w4s3")
    with pytest.raises(ValueError):
        PrefillLaunch(block_m=8)
    with pytest.raises(ValueError):
        DecodeLaunch(num_warps=0)


def test_kv_pool_from_free_memory() -> None:
    assert kv_blocks_for_free_memory(100 << 30, 2 << 20, 10 << 30) == ((90 << 30) - (10 << 30)) // (2 << 20)
    assert kv_blocks_for_free_memory(1 << 30, 2 << 20, 4 << 30) == 0
    with pytest.raises(ValueError):
        kv_blocks_for_free_memory(1 << 30, 0, 0)
    reserve = step_reserve_bytes(GPU_STEP_TOKENS, 256, 4096, 14336, 6144, 128256, 2)
    assert 1 << 30 < reserve < 4 << 30  # an 8B model: a few GiB, not tens
    # split decode attention's partials grow with the batch, not with the context
    full = decode_scratch_bytes(GPU_MAX_SEQS, 32, 128, 16)
    assert full == GPU_MAX_SEQS * 32 * 16 * 129 * 4 and decode_scratch_bytes(64, 32, 128, 16) * 4 == full


def test_cache_config_resolution_order() -> None:
    model = resolve_model("tiny").model_config()
    per_block = CacheConfig().block_bytes(model, 4)
    assert CacheConfig(num_blocks=7).resolve_num_blocks(model, 4, free_blocks=1000) == 7
    assert CacheConfig(memory_budget_bytes=10 * per_block).resolve_num_blocks(model, 4, 1000) == 10
    assert CacheConfig().resolve_num_blocks(model, 4, free_blocks=1000) == 1000
    assert CacheConfig().resolve_num_blocks(model, 4) == CPU_KV_BUDGET_BYTES // per_block
    with pytest.raises(ValueError):
        CacheConfig(memory_budget_bytes=-1)


def test_step_budget_follows_the_device() -> None:
    assert default_step_tokens(on_gpu=False) == 512
    assert default_step_tokens(on_gpu=True) == GPU_STEP_TOKENS >= 8192
    assert default_max_seqs(on_gpu=False) == 64 and default_max_seqs(on_gpu=True) == GPU_MAX_SEQS == 256
