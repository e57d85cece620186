"""Fused elementwise kernels (Triton): what costs 8 aten ops and a round trip to memory each in
eager torch costs one launch and one pass here.

Rounding follows ``reference``: statistics and activations in float32, rounded to the activation
dtype exactly where the reference model rounds (the normalised row before the weight multiply;
the SiLU before the multiply by ``up``; the residual after the add).

* ``rms_norm`` / ``add_rms_norm``: one program per row; the add variant updates the residual in
  place and returns the norm of the new residual (the residual stream never leaves the kernel
  between the add and the norm).
* ``silu_mul``: ``silu(gate) * up`` from the fused gate/up projection's output.
* ``rope_write_kv``: rotates the q and k heads inside the fused qkv projection's output in place
  and stores k and v at their cache slots; slot ``-1`` (a CUDA graph bucket's padding) stores
  nothing.
"""

from __future__ import annotations

import torch
import triton.language as tl

from pdserve.model_runtime.kernels.launch import Kernel, next_power_of_2


def _rms_norm_kernel(
    X,
    RES,
    DELTA,
    W,
    Y,
    stride_x,
    stride_res,
    stride_delta,
    stride_y,
    n_cols,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if ADD:
        r = tl.load(RES + row * stride_res + cols, mask=mask, other=0.0)
        d = tl.load(DELTA + row * stride_delta + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + d.to(tl.float32)).to(r.dtype)
        tl.store(RES + row * stride_res + cols, x, mask=mask)
    else:
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (normed * w.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def _silu_mul_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (act * up.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def _rope_write_kv_kernel(
    QKV,
    POS,
    COS,
    SIN,
    KV,
    SLOTS,
    stride_qkv,
    stride_cos,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HALF
    row = QKV + tok * stride_qkv
    if head < NUM_HEADS + NUM_KV_HEADS:
        pos = tl.load(POS + tok).to(tl.int64)
        cos = tl.load(COS + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(SIN + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(row + head * 2 * HALF + offs, mask=mask, other=0.0)
        x2 = tl.load(row + head * 2 * HALF + HALF + offs, mask=mask, other=0.0)
        # The reference rounds each product to the activation dtype before the sum.
        a1 = (x1.to(tl.float32) * cos).to(x1.dtype).to(tl.float32)
        b1 = (x2.to(tl.float32) * sin).to(x1.dtype).to(tl.float32)
        a2 = (x2.to(tl.float32) * cos).to(x1.dtype).to(tl.float32)
        b2 = (x1.to(tl.float32) * sin).to(x1.dtype).to(tl.float32)
        y1 = (a1 - b1).to(x1.dtype)
        y2 = (a2 + b2).to(x1.dtype)
        tl.store(row + head * 2 * HALF + offs, y1, mask=mask)
        tl.store(row + head * 2 * HALF + HALF + offs, y2, mask=mask)
        if head >= NUM_HEADS:
            slot = tl.load(SLOTS + tok).to(tl.int64)
            if slot >= 0:
                dst = (
                    KV
                    + (slot // BLOCK_SIZE) * stride_kv_block
                    + (slot % BLOCK_SIZE) * stride_kv_tok
                    + (head - NUM_HEADS) * stride_kv_head
                )
                tl.store(dst + offs, y1, mask=mask)
                tl.store(dst + HALF + offs, y2, mask=mask)
    else:
        slot = tl.load(SLOTS + tok).to(tl.int64)
        if slot >= 0:
            v_head = head - NUM_HEADS - NUM_KV_HEADS
            dst = (
                KV
                + stride_kv_kv
                + (slot // BLOCK_SIZE) * stride_kv_block
                + (slot % BLOCK_SIZE) * stride_kv_tok
                + v_head * stride_kv_head
            )
            src = row + head * 2 * HALF
            tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0.0), mask=mask)
            tl.store(dst + HALF + offs, tl.load(src + HALF + offs, mask=mask, other=0.0), mask=mask)


RMS_NORM = Kernel(_rms_norm_kernel)
SILU_MUL = Kernel(_silu_mul_kernel)
ROPE_WRITE_KV = Kernel(_rope_write_kv_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, cols = x.shape
    y = torch.empty_like(x)
    RMS_NORM.on(x.device.type)[(rows,)](
        x, x, x, weight, y, x.stride(0), 0, 0, y.stride(0), cols, eps, ADD=False, BLOCK=next_power_of_2(cols)
    )
    return y


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    rows, cols = residual.shape
    y = torch.empty_like(residual)
    RMS_NORM.on(residual.device.type)[(rows,)](
        residual, residual, delta, weight, y,
        0, residual.stride(0), delta.stride(0), y.stride(0),
        cols, eps, ADD=True, BLOCK=next_power_of_2(cols),
    )  # fmt: skip
    return y


def silu_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    rows, width = x.shape
    n = width // 2
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    SILU_MUL.on(x.device.type)[(rows, -(-n // block))](x, y, x.stride(0), y.stride(0), n, BLOCK=block)
    return y


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
    n_tok = qkv.shape[0]
    half = cos_table.shape[1]
    s = kv_layer.stride()
    ROPE_WRITE_KV.on(qkv.device.type)[(n_tok, num_heads + 2 * num_kv_heads)](
        qkv, positions, cos_table, sin_table, kv_layer, slot_mapping,
        qkv.stride(0), cos_table.stride(0),
        s[0], s[1], s[2], s[3],
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=kv_layer.shape[2],
        HALF=half, BLOCK_H=next_power_of_2(half),
    )  # fmt: skip
