"""The Triton kernels, run by Triton's interpreter on CPU tensors, against their torch references.

Every cache slot a kernel must not read holds NaN (unused blocks, the tail of each sequence's
last block, positions before a sliding window), and outputs are NaN before each run: a kernel
that reads a wrong slot or leaves an element unwritten fails, instead of passing on zeros.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pdserve.model_runtime import attention_tuning
from pdserve.model_runtime.kernels import fused, reference
from pdserve.model_runtime.kernels import paged_attention as pa
from pdserve.model_runtime.kv_cache.tensors import new_kv_cache

BLOCK = 16
DIM = 32


def _tables(lens: list[int], width: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct random blocks per row, never block 0 (padding entries point there)."""
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    rows = []
    for n in lens:
        used = -(-n // BLOCK)
        rows.append([perm.pop() for _ in range(used)] + [0] * (width - used))
    return torch.tensor(rows, dtype=torch.int32)


def _poisoned(clean: torch.Tensor, tables: torch.Tensor, lens: list[int], firsts: list[int]) -> torch.Tensor:
    """A copy of the layer cache where only each row's readable positions keep their values."""
    kv = torch.full_like(clean, float("nan"))
    for row, (n, first) in enumerate(zip(lens, firsts, strict=True)):
        for pos in range(first, n):
            block = int(tables[row, pos // BLOCK])
            kv[block, :, pos % BLOCK] = clean[block, :, pos % BLOCK]
    return kv


def _layer(num_blocks: int, kv_heads: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # Layer 1 of a 3-layer block-major cache: a strided view, as the engine passes it.
    cache = new_kv_cache((3, num_blocks, 2, BLOCK, kv_heads, DIM), dtype)
    cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    layer = cache[1]
    assert not layer.is_contiguous()
    return layer


@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("window", [0, 21])
@pytest.mark.parametrize(
    "splits", [(8, 16), (3, 16), (1, 16), (64, 16), (4, 48)]
)  # many splits, some, one, more than any row fills, a floor above the tile
def test_decode_kernel_matches_reference(group: int, window: int, splits: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(group * 100 + window + sum(splits))
    kv_heads = 2
    lens = [1, 16, 17, 70, 0, 33]  # ragged, block-aligned, and a padding row
    width = 6
    clean = _layer(64, kv_heads, torch.float32, gen)
    tables = _tables(lens, width, 64, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    firsts = [max(0, n - window) if window else 0 for n in lens]
    kv = _poisoned(clean, tables, lens, firsts)
    q = torch.randn(len(lens), kv_heads * group, DIM, generator=gen)
    out = torch.full_like(q, float("nan"))
    launch = pa.DecodeLaunch(block_n=16)
    pa.paged_decode(q, kv, tables, seq_lens, 0.2, window, *splits, launch, out=out)
    want = reference.paged_decode(q, clean, tables, seq_lens, 0.2, window)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[4], torch.zeros_like(out[4]))  # length 0: zeros, not NaN
    alone = pa.paged_decode(q[3:4], kv, tables[3:4], seq_lens[3:4], 0.2, window, *splits, launch)
    assert torch.equal(alone[0], out[3])  # a row's result does not depend on its batch


def test_the_process_tuning_is_what_the_kernels_launch_with() -> None:
    # block_n sets the order of a row's sums: the tuning in use must be the one launched
    gen = torch.Generator().manual_seed(7)
    lens = [70, 33]
    clean = _layer(64, 2, torch.float32, gen)
    tables = _tables(lens, 6, 64, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(2, 8, DIM, generator=gen)
    tuned = attention_tuning.AttentionTuning(3, 16, attention_tuning.DecodeLaunch(32, 2, 1))
    explicit = pa.paged_decode(q, clean, tables, seq_lens, 0.2, 0, 3, 16, tuned.decode)
    default = pa.paged_decode(q, clean, tables, seq_lens, 0.2, 0, 3, 16, attention_tuning.DEFAULT.decode)
    assert not torch.equal(default, explicit)  # so the launch used is told apart
    attention_tuning.use(tuned)
    try:
        assert attention_tuning.current() is tuned
        implied = pa.paged_decode(q, clean, tables, seq_lens, 0.2, 0, 3, 16)
    finally:
        attention_tuning.use(attention_tuning.DEFAULT)
    assert torch.equal(implied, explicit)
    assert attention_tuning.current() == attention_tuning.AttentionTuning()


@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("window", [0, 9])
def test_prefill_kernel_matches_reference(group: int, window: int) -> None:
    gen = torch.Generator().manual_seed(group + window)
    kv_heads = 2
    # (start position, new tokens): fresh prompts and chunks continuing a cached prefix.
    chunks = [(0, 5), (30, 20), (7, 1), (0, 40), (16, 16)]
    lens = [s + n for s, n in chunks]
    width = max(-(-n // BLOCK) for n in lens)
    clean = _layer(64, kv_heads, torch.float32, gen)
    tables = _tables(lens, width, 64, gen)
    firsts = [max(0, s - window + 1) if window else 0 for s, _ in chunks]
    kv = _poisoned(clean, tables, lens, firsts)
    cu = torch.tensor(
        [0] + [sum(n for _, n in chunks[: i + 1]) for i in range(len(chunks))], dtype=torch.int32
    )
    starts = torch.tensor([s for s, _ in chunks], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), kv_heads * group, DIM, generator=gen)
    out = torch.full_like(q, float("nan"))
    max_q = max(n for _, n in chunks)
    pa.paged_prefill(q, kv, tables, cu, starts, max_q, 0.3, window, pa.PrefillLaunch(16, 16), out=out)
    want = reference.paged_prefill(q, clean, tables, cu, starts, max_q, 0.3, window)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_kernels_round_as_the_reference(dtype: torch.dtype) -> None:
    # float16 rounds away the float32 reduction order (a row's sum of squares adds up in another
    # order than torch's mean), so it must be exact; float32 may differ in its last bits. The
    # interpreter's bfloat16 conversion truncates (a GPU's rounds to nearest): bfloat16 rounding
    # is checked on the GPU run.
    gen = torch.Generator().manual_seed(1)

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        if dtype == torch.float16:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)

    x = torch.randn(7, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    same(fused.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    res_a, res_b = x.clone(), x.clone()
    delta = torch.randn(7, 96, generator=gen).to(dtype)
    normed = fused.add_rms_norm(res_a, delta, w, 1e-5)
    same(normed, reference.add_rms_norm(res_b, delta, w, 1e-5))
    assert torch.equal(res_a, res_b)  # the residual add itself is one rounding either way
    gate_up = torch.randn(7, 2 * 80, generator=gen).to(dtype)
    same(fused.silu_mul(gate_up, block=32), reference.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_write_kv_rotates_in_place_and_skips_padding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim = 4, 2, 24  # a head_dim that is not a power of two (Mistral test model)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 7, 1, 2, 9], dtype=torch.int32)
    cos = torch.randn(20, dim // 2, generator=gen).to(dtype)
    sin = torch.randn(20, dim // 2, generator=gen).to(dtype)
    slots = torch.tensor([0, 5, -1, 9, 11, 2], dtype=torch.int32)
    cache = new_kv_cache((2, 4, 2, 4, kv_heads, dim), dtype)[1]
    cache.fill_(7.0)
    got_qkv, got_cache = qkv.clone(), cache.clone()
    fused.rope_write_kv(got_qkv, positions, cos, sin, got_cache, slots, heads, kv_heads)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    reference.rope_write_kv(want_qkv, positions, cos, sin, want_cache, slots, heads, kv_heads)
    assert torch.equal(got_qkv, want_qkv)
    assert torch.equal(got_cache, want_cache)
    written = {0, 5, 9, 11, 2}
    untouched = [s for s in range(16) if s not in written]
    flat = got_cache.permute(0, 2, 1, 3, 4).reshape(16, 2, kv_heads, dim)
    assert bool((flat[untouched] == 7.0).all())
