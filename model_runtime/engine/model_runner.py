"""Runs one planned step: build the batch, run the model, sample. Owns the KV cache tensor.

The ``torch`` backend builds ``AttentionMetadata`` per step (``batch``); the ``paged`` backend
packs the step into one int32 buffer (``step_inputs``) and replays decode-only steps from CUDA
graphs (``decode_graphs``) when it has them.

``launch`` queues a step and returns before the device is done; ``execute`` waits. A step's
``pending`` rows take as input the tokens of the step launched just before, which stay on the
device (``_previous``), so the next decode step can be queued before the host has read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from pdserve.model_runtime.backend import Backend, graph_buckets
from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.engine.batch import build_batch
from pdserve.model_runtime.engine.decode_graphs import DecodeGraphs
from pdserve.model_runtime.engine.runner import DoneStep, StepHandle, StepResult
from pdserve.model_runtime.engine.step_inputs import Stager, fill_pending, pack_step, token_sources, unpack
from pdserve.model_runtime.kv_cache.tensors import allocate_kv_cache
from pdserve.model_runtime.model.llama import LlamaModel
from pdserve.model_runtime.parallel.launch import RankSetup
from pdserve.model_runtime.parallel.messages import Step
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling.sampler import SampledStep, Sampler, SampleRow
from pdserve.model_runtime.scheduler.plan import ScheduledChunk
from pdserve.model_runtime.structured.compiler import Grammars


class _LaunchedStep:
    """A model step queued on the device; ``result`` waits for its sampled ids."""

    def __init__(self, sample_ids: list[str], sampled: SampledStep) -> None:
        self.sample_ids, self.sampled = sample_ids, sampled

    def result(self) -> StepResult:
        out = self.sampled.result()
        sampled = dict(zip(self.sample_ids, out.token_ids, strict=True))
        lps = {rid: lp for rid, lp in zip(self.sample_ids, out.logprobs, strict=True) if lp is not None}
        return StepResult(sampled, lps)


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
        tp: RankSetup | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        """``tp``: this runner is one rank of a tensor-parallel worker. On rank 0 every step is
        first sent to the other ranks (``Step``), whose runners ``follow`` it; ``layer_pushes``
        names the step's layer-wise KV pushes they ship their parts of."""
        self.config = config
        self.tp = tp
        self.layer_pushes: Callable[[], tuple[str, ...]] = tuple
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.dtype = model.dtype
        if kv_cache is None:
            kv_cache = allocate_kv_cache(config, num_blocks, block_size, self.dtype, self.device)
        self.kv_cache = kv_cache
        self.sampler = Sampler(grammars, config.eos_token_ids)
        # The last launched step's sampled rows by request id, and its tokens on the device.
        self._previous: tuple[dict[str, int], torch.Tensor] | None = None
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
        """The request is gone: drop its penalty counts and grammar matcher (the only
        per-request state; seeded draws depend on the seed and the token's position alone)."""
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
        return self._launch(chunks, requests, on_layer).result()

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> StepHandle:
        """Queue one step and return; ``result()`` waits for its tokens."""
        return self._launch(chunks, requests, None)

    def _launch(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None,
    ) -> StepHandle:
        previous, self._previous = self._previous, None
        if not chunks:
            return DoneStep(StepResult({}, {}))
        if self.tp is not None and self.tp.ranks is not None:
            self.tp.ranks.send(Step(tuple(chunks), self.layer_pushes()))
        logits, sample_ids = self._forward(chunks, on_layer, previous)
        if not sample_ids:
            return DoneStep(StepResult({}, {}))
        pending = {c.request_id for c in chunks if c.pending}
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
                    pending=int(rid in pending),
                )
            )
        sampled = self.sampler.launch(logits, rows)
        self._previous = ({rid: i for i, rid in enumerate(sample_ids)}, sampled.tokens)
        return _LaunchedStep(sample_ids, sampled)

    def follow(self, chunks: Sequence[ScheduledChunk], on_layer: Callable[[int], None] | None) -> None:
        """Rank > 0 of a tensor-parallel worker: run the step rank 0 sent (its pending inputs
        arrive by broadcast; the logits are rank 0's to sample)."""
        pending = any(c.pending for c in chunks)
        if pending:  # the inputs come from rank 0, not from this rank's (absent) samples
            chunks = [replace(c, pending=False) if c.pending else c for c in chunks]
        self._forward(chunks, on_layer, None, share_pending=pending)

    def _share_pending(self, input_ids: torch.Tensor) -> None:
        """Rank 0 filled the pending rows' inputs from its last sampled tokens; the other ranks
        take them from it."""
        if self.tp is not None:
            self.tp.group.broadcast(input_ids)

    def _forward(
        self,
        chunks: Sequence[ScheduledChunk],
        on_layer: Callable[[int], None] | None,
        previous: tuple[dict[str, int], torch.Tensor] | None,
        share_pending: bool = False,
    ) -> tuple[torch.Tensor, list[str]]:
        """Logits of the sampled rows and their request ids, in row order. ``previous``: the
        last launched step's sampled rows and tokens, the inputs of ``pending`` chunks."""
        pending = any(c.pending for c in chunks)
        if pending and previous is None:
            raise RuntimeError("a pending input with no step launched before it")
        share_pending = share_pending or (pending and self.tp is not None)
        if not self.paged:
            batch = build_batch(chunks, self.block_size, self.device, self.config.sliding_window)
            if pending and previous is not None:
                src = torch.tensor(token_sources(chunks, previous[0]), dtype=torch.long, device=self.device)
                fill_pending(batch.input_ids, src, previous[1])
            if share_pending:
                self._share_pending(batch.input_ids)
            logits = self.model.forward(
                batch.input_ids, batch.positions, batch.meta, self.kv_cache, batch.sample_rows, on_layer
            )
            return logits, batch.sample_ids
        if self.graphs is not None and on_layer is None and self.graphs.fits(chunks):
            return self.graphs.run(chunks, previous)
        assert self.stager is not None
        packed = pack_step(chunks, self.block_size, previous[0] if previous is not None else None)
        inp = unpack(
            self.stager.stage(packed.values), packed.layout, packed.prefill_max_q, self.window, False
        )
        if pending and previous is not None:
            fill_pending(inp.input_ids, inp.sources, previous[1])
        if share_pending:
            self._share_pending(inp.input_ids)
        logits = self.model.forward(
            inp.input_ids, inp.positions, inp.meta, self.kv_cache, inp.sample_rows, on_layer
        )
        return logits, packed.sample_ids
