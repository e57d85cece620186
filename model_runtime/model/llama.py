"""One implementation for Llama, Qwen2 and Mistral (they differ only in biases, tying and window).

Projections are ``Linear`` objects (``model.linear``) that keep each weight in the fastest form
for the device; q/k/v and gate/up are fused at load time, so each layer runs four matrix
multiplies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.model.attention import AttentionMetadata, paged_attention, write_kv
from pdserve.model_runtime.model.layers import Rotary, rms_norm
from pdserve.model_runtime.model.linear import Linear


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> q + 2 kv
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear


class LlamaModel:
    """Forward pass over a packed batch; ``kv_cache`` is [layers, blocks, 2, block_size, kv_heads, dim]."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: Linear,
        max_positions: int,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.device = embed.device
        self.dtype = embed.dtype
        self.rotary = Rotary(config.head_dim, max_positions, config.rope, self.device, self.dtype)
        self.scale = config.head_dim**-0.5

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        sample_rows: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits (float32) of the rows in ``sample_rows``; writes every token's KV to the cache.

        ``on_layer(i)`` runs once layer ``i``'s keys and values are in the cache (layer-wise KV
        streaming starts shipping layer i while layer i+1 computes).
        """
        cfg = self.config
        eps = cfg.rms_norm_eps
        n_tok = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.tables(positions)
        k_end = cfg.q_size + cfg.kv_size
        n_qk_heads = cfg.num_heads + cfg.num_kv_heads
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, eps)
            qkv = w.qkv(x)
            # q and k heads sit side by side in the fused output: rotate them in one pass.
            qk = self.rotary.apply(qkv[:, :k_end].view(n_tok, n_qk_heads, cfg.head_dim), cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, k_end:].view(n_tok, cfg.num_kv_heads, cfg.head_dim)
            kv_layer = kv_cache[i]
            write_kv(kv_layer, k, v, meta)
            attn = paged_attention(q, k, v, kv_layer, meta, self.scale)
            h = h + w.o(attn.view(n_tok, cfg.q_size))
            x = rms_norm(h, w.post_norm, eps)
            gate, up = w.gate_up(x).chunk(2, dim=-1)
            h = h + w.down(F.silu(gate) * up)
            if on_layer is not None:
                on_layer(i)
        h = rms_norm(h[sample_rows], self.final_norm, eps)
        return self.lm_head(h).float()
