"""Decode steps replayed from CUDA graphs, one per batch bucket (``backend.graph_buckets``).

A decode step's work is fixed by its batch size once every index it reads lives at a fixed
address: the bucket's ``StepLayout`` (block tables as wide as the longest sequence the engine
allows) over this object's own staging buffers. Capture records embedding → logits for each
bucket once; a step then costs one packed host→device copy and one ``replay``, however many
layers and kernels the model has. Without CUDA (tests, CPU), ``capture=False`` runs the same
views eagerly, which is how the fixed shapes and addresses are checked.

Contract: the buffers and graphs belong to this object; the logits a step returns are a view
of the bucket's output and are valid until the next ``run``. Padding rows (bucket minus real
rows) write no KV and read none, so no block of any sequence is touched by them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pdserve.model_runtime.backend import bucket_for
from pdserve.model_runtime.engine.step_inputs import (
    Stager,
    StepInputs,
    StepLayout,
    fill_pending,
    source_of,
    unpack,
)
from pdserve.model_runtime.model.llama import LlamaModel
from pdserve.model_runtime.scheduler.plan import ScheduledChunk


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        buckets: Sequence[int],
        decode_width: int,
        block_size: int,
        window: int,
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = tuple(sorted(buckets))
        self.decode_width = decode_width
        self.block_size = block_size
        self.layouts = {b: StepLayout(b, 0, b, decode_width, 0, 0) for b in self.buckets}
        self.stager = Stager(model.device, capacity=max(layout.size for layout in self.layouts.values()))
        buffer = self.stager.device_buffer
        self.inputs: dict[int, StepInputs] = {
            b: unpack(buffer, layout, 0, window, sample_all=True) for b, layout in self.layouts.items()
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def _forward(self, bucket: int) -> torch.Tensor:
        inp = self.inputs[bucket]
        return self.model.forward(inp.input_ids, inp.positions, inp.meta, self.kv_cache, None)

    def _stage(
        self, chunks: Sequence[ScheduledChunk], bucket: int, previous: Mapping[str, int] | None = None
    ) -> None:
        """Write the step into the bucket's layout in the host buffer and upload it.

        Only what changes is written: each row's id, position, slot and length, and the used
        prefix of its block table (as wide as ``max_model_len`` allows and mostly unused:
        rewriting every column each step would cost more host time than the GPU's step). Columns
        past a row's length are never read (the kernels stop at the length), so stale ones are
        harmless; padding rows (and the warm-up runs, all padding) get slot -1 and length 0, so
        they write and read no KV.
        """
        n, bs = len(chunks), self.block_size
        host = self.stager.host(self.layouts[bucket].size)
        views = unpack(torch.from_numpy(host), self.layouts[bucket], 0, 0, sample_all=True)
        ids, pos, src = views.input_ids.numpy(), views.positions.numpy(), views.sources.numpy()
        slots, lens = views.meta.slot_mapping.numpy(), views.meta.decode_seq_lens.numpy()
        tables = views.meta.decode_block_tables.numpy()
        prev = previous or {}
        for i, c in enumerate(chunks):
            p = c.start_pos
            ids[i], pos[i], lens[i], src[i] = c.token_ids[0], p, p + 1, source_of(c, prev)
            slots[i] = c.block_table[p // bs] * bs + p % bs
            used = p // bs + 1
            tables[i, :used] = c.block_table[:used]
        ids[n:], pos[n:], slots[n:], lens[n:], src[n:] = 0, 0, -1, 0, -1
        self.stager.upload(len(host))

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            self._stage((), bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # Triton compiles and autotunes outside the capture
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """A decode-only step, every row sampled, within the largest bucket and table width."""
        return (
            bool(chunks)
            and bucket_for(len(chunks), self.buckets) is not None
            and all(c.is_decode and c.start_pos // self.block_size < self.decode_width for c in chunks)
        )

    def run(
        self, chunks: Sequence[ScheduledChunk], previous: tuple[Mapping[str, int], torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, list[str]]:
        """Logits of the step's rows (in ``sample_ids`` order) and those ids; ``fits`` must hold.
        ``previous``: the last step's sampled rows by request id and its tokens on the device,
        which ``pending`` rows take as their input (outside the graph, before the replay)."""
        bucket = bucket_for(len(chunks), self.buckets)
        assert bucket is not None
        self._stage(chunks, bucket, previous[0] if previous is not None else None)
        if any(c.pending for c in chunks):
            assert previous is not None
            inp = self.inputs[bucket]
            fill_pending(inp.input_ids, inp.sources, previous[1])
        if self.graphs:
            self.graphs[bucket].replay()
            logits = self.outputs[bucket]
        else:
            logits = self._forward(bucket)
        return logits[: len(chunks)], [c.request_id for c in chunks]
