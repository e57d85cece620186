"""The ``pdserve::`` custom ops: one dispatcher call per fused operation, whatever runs it.

On CUDA tensors an op launches its Triton kernel; on CPU tensors it runs the torch reference
(``reference``), or the Triton kernel under the interpreter inside ``kernels_on_cpu()`` (tests);
on ``meta`` tensors and under tracing only its shape function runs. Being custom ops is what lets
``torch.compile(fullgraph=True)`` trace the model without breaking at a kernel launch, a
``TorchDispatchMode`` count each as one op, and the decode graph run on the ``meta`` device —
proof that nothing in it reads device data on the host.

Mutation contracts: ``add_rms_norm`` updates ``residual`` in place; ``rope_write_kv`` rotates
``qkv`` in place and writes ``kv_layer`` at the slots given (negative: nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.library import custom_op

from pdserve.model_runtime.kernels import reference

_kernels_on_cpu = False


@contextlib.contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """Run the Triton kernels (interpreted) for CPU tensors in this block, instead of the
    references: end-to-end checks of the kernels' plumbing without a GPU."""
    global _kernels_on_cpu
    before, _kernels_on_cpu = _kernels_on_cpu, True
    try:
        yield
    finally:
        _kernels_on_cpu = before


def _triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or (_kernels_on_cpu and t.device.type == "cpu")


@custom_op("pdserve::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _triton(x):
        from pdserve.model_runtime.kernels import fused

        return fused.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@custom_op("pdserve::add_rms_norm", mutates_args=("residual",))
def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if _triton(residual):
        from pdserve.model_runtime.kernels import fused

        return fused.add_rms_norm(residual, delta, weight, eps)
    return reference.add_rms_norm(residual, delta, weight, eps)


@add_rms_norm.register_fake
def _(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(residual)


@custom_op("pdserve::silu_mul", mutates_args=())
def silu_mul(x: torch.Tensor) -> torch.Tensor:
    if _triton(x):
        from pdserve.model_runtime.kernels import fused

        return fused.silu_mul(x)
    return reference.silu_mul(x)


@silu_mul.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@custom_op("pdserve::rope_write_kv", mutates_args=("qkv", "kv_layer"))
def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    if _triton(qkv):
        from pdserve.model_runtime.kernels import fused

        fused.rope_write_kv(
            qkv, positions, cos_table, sin_table, kv_layer, slot_mapping, num_heads, num_kv_heads
        )
    else:
        reference.rope_write_kv(
            qkv, positions, cos_table, sin_table, kv_layer, slot_mapping, num_heads, num_kv_heads
        )


@rope_write_kv.register_fake
def _(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    return None


@custom_op("pdserve::paged_decode", mutates_args=())
def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    num_splits: int,
    min_split_tokens: int,
) -> torch.Tensor:
    if _triton(q):
        from pdserve.model_runtime.kernels import paged_attention

        return paged_attention.paged_decode(
            q, kv_layer, block_tables, seq_lens, scale, window, num_splits, min_split_tokens
        )
    return reference.paged_decode(q, kv_layer, block_tables, seq_lens, scale, window)


@paged_decode.register_fake
def _(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    num_splits: int,
    min_split_tokens: int,
) -> torch.Tensor:
    return torch.empty_like(q)


@custom_op("pdserve::paged_prefill", mutates_args=())
def paged_prefill(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    start_pos: torch.Tensor,
    max_q_len: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    if _triton(q):
        from pdserve.model_runtime.kernels import paged_attention

        return paged_attention.paged_prefill(
            q, kv_layer, block_tables, cu_q, start_pos, max_q_len, scale, window
        )
    return reference.paged_prefill(q, kv_layer, block_tables, cu_q, start_pos, max_q_len, scale, window)


@paged_prefill.register_fake
def _(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q: torch.Tensor,
    start_pos: torch.Tensor,
    max_q_len: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    return torch.empty_like(q)
