"""Attention over the paged KV cache for a packed batch (torch, same code on CPU and CUDA).

A step packs every scheduled token into one [T, ...] batch. Linear layers run on all T tokens at
once; attention groups them:

* decode tokens (one new token per sequence) run as one padded, masked SDPA call, reading each
  sequence's keys and values through its block table;
* each prefill chunk runs its own SDPA call: a chunk starting at position 0 attends to its own
  fresh keys with a causal kernel; a chunk continuing cached context (prefix hit, chunked prefill,
  recompute) reads the cached part through its block table and uses a bottom-right causal mask.

The new tokens' keys and values are written into their slots first, so every read sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    token_start: int  # index of the chunk's first token in the packed batch
    token_end: int
    start_pos: int  # absolute position of the first token (tokens before it are cached)
    cached_blocks: torch.Tensor | None  # blocks holding positions [0, start_pos), when start_pos > 0
    mask: torch.Tensor | None  # [n, start_pos + n] bool, when a plain causal kernel will not do


@dataclass
class AttentionMetadata:
    """Per-step index tensors shared by every layer."""

    slot_blocks: torch.Tensor  # [T] block id of each new token
    slot_offsets: torch.Tensor  # [T] offset inside its block
    decode_rows: torch.Tensor | None  # [Bd] rows of decode tokens in the packed batch
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool, True = attend
    decode_contiguous: bool  # decode rows are 0..Bd-1 (the scheduler puts decodes first)
    prefills: list[PrefillSeq]
    block_size: int


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store new keys/values: ``kv_layer`` is [num_blocks, 2, block_size, kv_heads, head_dim]."""
    kv_layer[meta.slot_blocks, 0, meta.slot_offsets] = k
    kv_layer[meta.slot_blocks, 1, meta.slot_offsets] = v


def gather_blocks(kv_layer: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``blocks`` ([..., nb], int32 or int64) as [..., nb * block_size, heads,
    dim] each.

    One ``index_select`` of the key half and one of the value half, each straight into a
    contiguous result (plain advanced indexing followed by a K/V split costs two copies and is
    several times slower). ``kv_layer`` need not be contiguous (the cache is stored
    block-major): each block's keys, and its values, are.
    """
    rows = blocks.reshape(-1)
    shape = (*blocks.shape[:-1], -1, *kv_layer.shape[-2:])
    return kv_layer[:, 0].index_select(0, rows).view(shape), kv_layer[:, 1].index_select(0, rows).view(shape)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (already written to the cache). Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        keys, values = gather_blocks(kv_layer, meta.decode_block_tables)  # [Bd, L, Hkv, D]
        qd = q[: meta.decode_rows.numel()] if meta.decode_contiguous else q[meta.decode_rows]
        bd, n_q, dim = qd.shape
        n_kv = keys.shape[2]
        # The query heads sharing a KV head act as that head's queries: [Bd, Hkv, group, D].
        # One token has no causal structure, so this is exact, and no K/V is repeated.
        o = F.scaled_dot_product_attention(
            qd.view(bd, n_kv, n_q // n_kv, dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=scale,
        ).reshape(bd, n_q, dim)
        if meta.decode_contiguous:
            out[: o.shape[0]] = o
        else:
            out[meta.decode_rows] = o
    for p in meta.prefills:
        qs = q[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        ks, vs = k[p.token_start : p.token_end], v[p.token_start : p.token_end]
        if p.cached_blocks is not None:
            ck, cv = gather_blocks(kv_layer, p.cached_blocks)
            ks = torch.cat((ck[: p.start_pos], ks), dim=0)
            vs = torch.cat((cv[: p.start_pos], vs), dim=0)
        o = F.scaled_dot_product_attention(
            qs,
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[p.token_start : p.token_end] = o.squeeze(0).transpose(0, 1)
    return out
