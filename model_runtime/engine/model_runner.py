"""Runs one planned step: build the batch, run the model, sample. Owns the KV cache tensor.

The ``torch`` backend builds ``AttentionMetadata`` per step (``batch``); the ``paged`` backend
packs the step into one int32 buffer (``step_inputs``) and replays decode-only steps from CUDA
graphs (``decode_graphs``) when it has them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve.model_runtime.backend import Backend, graph_buckets
from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.engine.batch import build_batch
from pdserve.model_runtime.engine.decode_graphs import DecodeGraphs
from pdserve.model_runtime.engine.runner import StepResult
from pdserve.model_runtime.engine.step_inputs import Stager, pack_step, unpack
from pdserve.model_runtime.kv_cache.tensors import allocate_kv_cache
from pdserve.model_runtime.model.llama import LlamaModel
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling.sampler import Sampler, SampleRow
from pdserve.model_runtime.scheduler.plan import ScheduledChunk


@dataclass(frozen=True)
class GraphSettings:
    """Decode CUDA graphs of the ``paged`` backend: buckets up to ``max_rows`` sequences, block
    tables wide enough for ``max_model_len``; ``capture=False`` runs the graphs' fixed-shape
    inputs eagerly (CPU, tests)."""

    max_rows: int
    max_model_len: int
    capture: bool = True


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        kv_cache: torch.Tensor | None = None,
        graphs: GraphSettings | None = None,
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
        self.window = config.sliding_window or 0
        self.paged = model.backend is Backend.PAGED
        self.stager = Stager(self.device) if self.paged else None
        self.graphs: DecodeGraphs | None = None
        if self.paged and graphs is not None:
            buckets = graph_buckets(graphs.max_rows)
            width = -(-graphs.max_model_len // block_size)
            self.graphs = DecodeGraphs(
                model, kv_cache, buckets, width, block_size, self.window, capture=graphs.capture
            )

    def release(self, request_id: str) -> None:
        """The request is gone: drop its penalty counts (the only per-request state; seeded
        draws depend on the seed and the token's position alone)."""
        self.sampler.release(request_id)

    def kept_requests(self) -> int:
        return self.sampler.kept_requests()

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        """Run one step. ``on_layer(i)``: layer ``i``'s KV is written (for layer-wise transfer)."""
        if not chunks:
            return StepResult({}, {})
        logits, sample_ids = self._forward(chunks, on_layer)
        if not sample_ids:
            return StepResult({}, {})
        rows = []
        for rid in sample_ids:
            req = requests[rid]
            rows.append(
                SampleRow(
                    params=req.params,
                    prompt_ids=req.prompt_token_ids,
                    output_ids=req.output_token_ids,
                    eos_ids=req.eos_token_ids,
                    request_id=rid,
                )
            )
        result = self.sampler(logits, rows)
        sampled = dict(zip(sample_ids, result.token_ids, strict=True))
        lps = {rid: lp for rid, lp in zip(sample_ids, result.logprobs, strict=True) if lp is not None}
        return StepResult(sampled, lps)

    def _forward(
        self, chunks: Sequence[ScheduledChunk], on_layer: Callable[[int], None] | None
    ) -> tuple[torch.Tensor, list[str]]:
        """Logits of the sampled rows and their request ids, in row order."""
        if not self.paged:
            batch = build_batch(chunks, self.block_size, self.device, self.config.sliding_window)
            logits = self.model.forward(
                batch.input_ids, batch.positions, batch.meta, self.kv_cache, batch.sample_rows, on_layer
            )
            return logits, batch.sample_ids
        if self.graphs is not None and on_layer is None and self.graphs.fits(chunks):
            return self.graphs.run(chunks)
        assert self.stager is not None
        packed = pack_step(chunks, self.block_size)
        inp = unpack(
            self.stager.stage(packed.values), packed.layout, packed.prefill_max_q, self.window, False
        )
        logits = self.model.forward(
            inp.input_ids, inp.positions, inp.meta, self.kv_cache, inp.sample_rows, on_layer
        )
        return logits, packed.sample_ids
