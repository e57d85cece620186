"""One implementation for Llama, Qwen2 and Mistral (they differ only in biases, tying and window).

Weights are plain tensors in the Hugging Face [out, in] layout; q/k/v and gate/up projections
are fused at load time so each layer runs four matrix multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_runtime.config import ModelConfig
from model_runtime.model.attention import AttentionMetadata, paged_attention, write_kv
from model_runtime.model.layers import Rotary, rms_norm


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class LlamaModel:
    """Forward pass over a packed batch; ``kv_cache`` is [layers, blocks, 2, block_size, kv_heads, dim]."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
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
    ) -> torch.Tensor:
        """Logits (float32) of the rows in ``sample_rows``; writes every token's KV to the cache."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        n_tok = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.tables(positions)
        q_end, k_end = cfg.q_size, cfg.q_size + cfg.kv_size
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias)
            q = qkv[:, :q_end].view(n_tok, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_end:k_end].view(n_tok, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, k_end:].view(n_tok, cfg.num_kv_heads, cfg.head_dim)
            q = self.rotary.apply(q, cos, sin)
            k = self.rotary.apply(k, cos, sin)
            kv_layer = kv_cache[i]
            write_kv(kv_layer, k, v, meta)
            attn = paged_attention(q, k, v, kv_layer, meta, self.scale)
            h = h + F.linear(attn.view(n_tok, cfg.q_size), w.o, w.o_bias)
            x = rms_norm(h, w.post_norm, eps)
            gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w.down, w.down_bias)
        h = rms_norm(h[sample_rows], self.final_norm, eps)
        return F.linear(h, self.lm_head).float()
