"""Runs one planned step: build the batch, run the model, sample. Owns the KV cache tensor."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.engine.batch import build_batch
from pdserve.model_runtime.engine.runner import StepResult
from pdserve.model_runtime.kv_cache.tensors import allocate_kv_cache
from pdserve.model_runtime.model.llama import LlamaModel
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling.sampler import Sampler, SampleRow
from pdserve.model_runtime.scheduler.plan import ScheduledChunk


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        kv_cache: torch.Tensor | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.dtype = model.dtype
        if kv_cache is None:
            kv_cache = allocate_kv_cache(config, num_blocks, block_size, self.dtype, self.device)
        self.kv_cache = kv_cache
        self.sampler = Sampler()

    def release(self, request_id: str) -> None:
        """The request is gone. The runner keeps no per-request state (seeded draws depend on
        the seed and the token's position alone), so there is nothing to drop; the hook stays
        for runners that do."""

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        """Run one step. ``on_layer(i)``: layer ``i``'s KV is written (for layer-wise transfer)."""
        if not chunks:
            return StepResult({}, {})
        batch = build_batch(chunks, self.block_size, self.device, self.config.sliding_window)
        logits = self.model.forward(
            batch.input_ids, batch.positions, batch.meta, self.kv_cache, batch.sample_rows, on_layer
        )
        if not batch.sample_ids:
            return StepResult({}, {})
        rows = []
        for rid in batch.sample_ids:
            req = requests[rid]
            rows.append(
                SampleRow(
                    params=req.params,
                    prompt_ids=req.prompt_token_ids,
                    output_ids=req.output_token_ids,
                    eos_ids=req.eos_token_ids,
                )
            )
        result = self.sampler(logits, rows)
        sampled = dict(zip(batch.sample_ids, result.token_ids, strict=True))
        lps = {rid: lp for rid, lp in zip(batch.sample_ids, result.logprobs, strict=True) if lp is not None}
        return StepResult(sampled, lps)
