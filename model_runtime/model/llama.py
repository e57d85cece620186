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

from pdserve.model_runtime.backend import Backend
from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.model.attention import AttentionMetadata
from pdserve.model_runtime.model.layers import Rotary
from pdserve.model_runtime.model.linear import Linear, warm_up
from pdserve.model_runtime.model.ops import LayerOps, PagedMetadata, PagedOps, TorchOps
from pdserve.model_runtime.parallel.group import Collectives


@dataclass(frozen=True)
class VocabShard:
    """The embedding rows a tensor-parallel rank holds: token ids ``[start, start + count)``,
    padded to ``rows`` (equal on every rank, so the logits gather in one collective)."""

    start: int
    count: int
    rows: int
    vocab_size: int


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> q + 2 kv
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear


class LlamaModel:
    """Forward pass over a packed batch; ``kv_cache`` is [layers, blocks, 2, block_size, kv_heads, dim].

    The layer loop is the same for every backend; ``ops`` (``model.ops``) supplies the norms, the
    activation and attention, and the step metadata is whatever those ops read.

    With ``tp`` (one rank of a tensor-parallel worker), ``config`` is this rank's view
    (``sharding.rank_config``: its heads and MLP width), the weights are its shards, O and down
    are followed by an all-reduce, and the embedding and LM head hold ``vocab``'s rows: a token
    outside them embeds as zeros before the all-reduce, and the logits are gathered whole, so
    every rank returns the full vocabulary's logits and sampling is the TP 1 sampling.
    """

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: Linear,
        max_positions: int,
        backend: Backend = Backend.TORCH,
        tp: Collectives | None = None,
        vocab: VocabShard | None = None,
    ) -> None:
        self.config = config
        self.tp = tp
        self.vocab = vocab
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.device = embed.device
        self.dtype = embed.dtype
        self.rotary = Rotary(config.head_dim, max_positions, config.rope, self.device, self.dtype)
        self.backend = backend
        self.ops: LayerOps = (PagedOps if backend is Backend.PAGED else TorchOps)(config, self.rotary)

    def warm_up(self, max_step_tokens: int, max_step_rows: int) -> int:
        """Create up front the per-shape state of the layers' products for steps of up to
        ``max_step_tokens`` tokens and of the head's for up to ``max_step_rows`` sampled rows
        (``linear.warm_up``); returns the number of products run."""
        layer_linears = [lin for w in self.layers for lin in (w.qkv, w.o, w.gate_up, w.down)]
        return warm_up(layer_linears, max_step_tokens) + warm_up([self.lm_head], max_step_rows)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | PagedMetadata,
        kv_cache: torch.Tensor,
        sample_rows: torch.Tensor | None,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits (float32) of the rows in ``sample_rows`` (every row when ``None``); writes every
        token's KV to the cache.

        ``on_layer(i)`` runs once layer ``i``'s keys and values are in the cache (layer-wise KV
        streaming starts shipping layer i while layer i+1 computes).
        """
        ops = self.ops
        tp = self.tp
        h = self._embed(input_ids)
        x = ops.rms_norm(h, self.layers[0].input_norm)
        last = len(self.layers) - 1
        for i, w in enumerate(self.layers):
            attn = ops.attention(w.qkv(x), positions, kv_cache[i], meta)
            out = w.o(attn)
            if tp is not None:
                tp.all_reduce(out)
            x = ops.add_rms_norm(h, out, w.post_norm)
            delta = w.down(ops.silu_mul(w.gate_up(x)))
            if tp is not None:
                tp.all_reduce(delta)
            if i < last:
                x = ops.add_rms_norm(h, delta, self.layers[i + 1].input_norm)
            else:
                h.add_(delta)
            if on_layer is not None:
                on_layer(i)
        rows = h if sample_rows is None else h[sample_rows]
        logits = self.lm_head(ops.rms_norm(rows, self.final_norm))
        if tp is not None and self.vocab is not None:
            logits = tp.all_gather(logits)[:, : self.vocab.vocab_size]
        return logits.float()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.vocab is None:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.count)
        h = F.embedding(local.masked_fill(outside, 0), self.embed)
        h.masked_fill_(outside.unsqueeze(-1), 0)
        self.tp.all_reduce(h)
        return h
