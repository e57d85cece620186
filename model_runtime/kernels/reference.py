"""The kernels' contracts in plain torch: what ``pdserve::`` ops compute on CPU, and the oracle the
Triton kernels are tested against.

Each function has the signature and the rounding of its kernel (norms and activations in float32,
rounded to the activation dtype where the reference model rounds), so a CPU engine running the
``paged`` backend gives the tokens the ``torch`` backend gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.model_runtime.model.attention import gather_blocks
from pdserve.model_runtime.model.layers import rms_norm, rotate

__all__ = ["add_rms_norm", "paged_decode", "paged_prefill", "rms_norm", "rope_write_kv", "silu_mul"]


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += delta`` in place; returns the RMSNorm of the new residual."""
    residual.add_(delta)
    return rms_norm(residual, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` = [..., 2 * n] holding gate then up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


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
    """Rotate the q and k heads of ``qkv`` [T, (Hq + 2 Hkv) * D] in place, and store k and v at
    their slots (``block * block_size + offset``; a negative slot is padding and stores nothing)."""
    n_tok = qkv.shape[0]
    block_size, dim = kv_layer.shape[2], kv_layer.shape[-1]
    n_qk = num_heads + num_kv_heads
    heads = qkv.view(n_tok, -1, dim)
    cos = cos_table[positions.long()].unsqueeze(1)
    sin = sin_table[positions.long()].unsqueeze(1)
    heads[:, :n_qk] = rotate(heads[:, :n_qk], cos, sin)
    slots = slot_mapping.long()
    k, v = heads[:, num_heads:n_qk], heads[:, n_qk:]
    keep = slots >= 0
    if not bool(keep.all()):  # a host read: this is the CPU implementation, not a graph's
        slots, k, v = slots[keep], k[keep], v[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_layer[blocks, 0, offsets] = k
    kv_layer[blocks, 1, offsets] = v


def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """One query token per row: ``q`` [B, Hq, D] over the first ``seq_lens[b]`` cached tokens of
    row ``b`` (the last ``window`` of them when ``window > 0``); rows of length 0 give zeros."""
    rows, n_q, dim = q.shape
    # Table columns past a row's length may hold anything (graph layouts leave stale ones, which
    # the kernels never read); here they are gathered and masked, so only made valid indices.
    keys, values = gather_blocks(kv_layer, block_tables.clamp(0, kv_layer.shape[0] - 1))  # [B, L, Hkv, D]
    n_kv = keys.shape[2]
    k_pos = torch.arange(keys.shape[1], device=q.device)
    lens = seq_lens.long().unsqueeze(1)
    allowed = k_pos < lens
    if window > 0:
        allowed &= k_pos >= lens - window
    empty = lens == 0
    o = F.scaled_dot_product_attention(
        q.view(rows, n_kv, n_q // n_kv, dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=(allowed | empty)[:, None, None, :],
        scale=scale,
    ).reshape(rows, n_q, dim)
    return torch.where(empty.unsqueeze(-1), 0, o)


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
    """Packed causal chunks (see ``paged_attention.paged_prefill``); one SDPA per sequence."""
    out = torch.empty_like(q)
    block_size = kv_layer.shape[2]
    bounds = cu_q.tolist()
    for i, start in enumerate(start_pos.tolist()):
        a, b = bounds[i], bounds[i + 1]
        end = start + b - a
        keys, values = gather_blocks(kv_layer, block_tables[i, : -(-end // block_size)])
        q_pos = torch.arange(start, end, device=q.device).unsqueeze(1)
        k_pos = torch.arange(end, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if window > 0:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).unsqueeze(0),
            keys[:end].transpose(0, 1).unsqueeze(0),
            values[:end].transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[a:b] = o.squeeze(0).transpose(0, 1)
    return out
