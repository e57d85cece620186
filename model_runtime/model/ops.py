"""The per-layer operations of a backend (``backend.Backend``): the model's layer loop is written
once against ``LayerOps`` and each backend supplies the operations and its step metadata.

``TorchOps`` is the CPU path as it always was (eager elementwise ops, gather + SDPA attention over
``AttentionMetadata``). ``PagedOps`` calls the ``pdserve::`` custom ops over ``PagedMetadata``:
one fused op each for the norms, RoPE with the KV write, SiLU·mul, and paged attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F

from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.kernels import ops as kops
from pdserve.model_runtime.model.attention import AttentionMetadata, paged_attention, write_kv
from pdserve.model_runtime.model.layers import Rotary, rms_norm


@dataclass
class PagedMetadata:
    """Per-step tensors of the ``paged`` backend, all views of one packed int32 buffer.

    Rows ``0 .. num_decodes-1`` of the step are decode tokens (one per sequence), the rest are
    prefill chunks packed back to back. A slot of ``-1`` (a graph bucket's padding row) writes no
    KV, and a ``decode_seq_lens`` of 0 reads none.
    """

    slot_mapping: torch.Tensor  # [T] block * block_size + offset
    num_decodes: int
    decode_block_tables: torch.Tensor  # [Bd, width]
    decode_seq_lens: torch.Tensor  # [Bd] tokens in the cache after this step's write
    decode_splits: int  # split-K programs per row and KV head in decode attention
    decode_min_split_tokens: int  # positions a split takes at least
    prefill_block_tables: torch.Tensor  # [Np, width]
    prefill_cu_q: torch.Tensor  # [Np + 1] row bounds, counted from row num_decodes
    prefill_start: torch.Tensor  # [Np] absolute position of each chunk's first token
    prefill_max_q: int
    window: int  # 0: none


class LayerOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``residual += delta`` in place; the RMSNorm of the result."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def attention(
        self, qkv: torch.Tensor, positions: torch.Tensor, kv_layer: torch.Tensor, meta: object
    ) -> torch.Tensor:
        """RoPE, the KV write and attention for one layer: ``qkv`` [T, q + 2 kv] → [T, q]."""
        ...


class TorchOps:
    def __init__(self, config: ModelConfig, rotary: Rotary) -> None:
        self.config = config
        self.rotary = rotary
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        residual.add_(delta)
        return rms_norm(residual, weight, self.eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention(
        self, qkv: torch.Tensor, positions: torch.Tensor, kv_layer: torch.Tensor, meta: object
    ) -> torch.Tensor:
        assert isinstance(meta, AttentionMetadata)
        cfg = self.config
        n_tok = qkv.shape[0]
        k_end = cfg.q_size + cfg.kv_size
        cos, sin = self.rotary.tables(positions)
        # q and k heads sit side by side in the fused output: rotate them in one pass.
        qk = self.rotary.apply(
            qkv[:, :k_end].view(n_tok, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin
        )
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        v = qkv[:, k_end:].view(n_tok, cfg.num_kv_heads, cfg.head_dim)
        write_kv(kv_layer, k, v, meta)
        return paged_attention(q, k, v, kv_layer, meta, self.scale).view(n_tok, cfg.q_size)


class PagedOps:
    def __init__(self, config: ModelConfig, rotary: Rotary) -> None:
        self.config = config
        self.cos, self.sin = rotary.cos, rotary.sin  # [max_positions, D/2]
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, kops.rms_norm(x, weight, self.eps))

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, kops.add_rms_norm(residual, delta, weight, self.eps))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, kops.silu_mul(gate_up))

    def attention(
        self, qkv: torch.Tensor, positions: torch.Tensor, kv_layer: torch.Tensor, meta: object
    ) -> torch.Tensor:
        assert isinstance(meta, PagedMetadata)
        cfg = self.config
        n_tok = qkv.shape[0]
        kops.rope_write_kv(
            qkv, positions, self.cos, self.sin, kv_layer, meta.slot_mapping, cfg.num_heads, cfg.num_kv_heads
        )
        q = qkv[:, : cfg.q_size].view(n_tok, cfg.num_heads, cfg.head_dim)
        nd = meta.num_decodes
        parts: list[torch.Tensor] = []
        if nd:
            parts.append(kops.paged_decode(
                q[:nd], kv_layer, meta.decode_block_tables, meta.decode_seq_lens, self.scale, meta.window,
                meta.decode_splits, meta.decode_min_split_tokens,
            ))  # fmt: skip
        if nd < n_tok:
            parts.append(kops.paged_prefill(
                q[nd:], kv_layer, meta.prefill_block_tables, meta.prefill_cu_q, meta.prefill_start,
                meta.prefill_max_q, self.scale, meta.window,
            ))  # fmt: skip
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(n_tok, cfg.q_size)
