"""A step's inputs for the ``paged`` backend: every index the forward pass reads, packed into one
int32 buffer, so a step costs one host→device copy whatever its shape.

Layout (``StepLayout``), segment after segment: input ids, positions, cache slots and input
sources of the ``rows`` tokens (a source ``i >= 0``: the input is row ``i`` of the tokens the
previous step sampled, still on the device; -1: the input id as written); the rows to sample;
decode sequence lengths and block tables (``decodes × decode_width``); prefill row bounds, start
positions and block tables. Decode rows come first (the forward's attention splits the batch
there). A layout fixes every offset, so a CUDA graph captured over the views of one layout
replays correctly for any step written into it (``decode_graphs`` pads to a bucket with rows
that write no KV, slot -1, and read none, length 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from pdserve.model_runtime import attention_tuning
from pdserve.model_runtime.model.ops import PagedMetadata
from pdserve.model_runtime.scheduler.plan import ScheduledChunk


@dataclass(frozen=True)
class StepLayout:
    rows: int
    samples: int
    decodes: int
    decode_width: int
    prefills: int
    prefill_width: int

    @property
    def size(self) -> int:
        prefill = (
            (self.prefills + 1 + self.prefills + self.prefills * self.prefill_width) if self.prefills else 0
        )
        return 4 * self.rows + self.samples + self.decodes * (1 + self.decode_width) + prefill


@dataclass
class StepInputs:
    """Views of one packed buffer (see the module docstring)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    sources: torch.Tensor  # per row: -1, or the previous step's sampled row that is its input
    sample_rows: torch.Tensor | None  # None: every row is sampled (a graph bucket)
    meta: PagedMetadata


@dataclass(frozen=True)
class PackedStep:
    values: list[int]
    layout: StepLayout
    sample_ids: list[str]  # request id of each sampled row, in row order
    prefill_max_q: int


def source_of(chunk: ScheduledChunk, previous: Mapping[str, int]) -> int:
    """The input source of a one-token chunk: its request's row among the previous step's
    sampled tokens when its input is pending, else -1."""
    if not chunk.pending:
        return -1
    row = previous.get(chunk.request_id)
    if row is None:
        raise RuntimeError(f"{chunk.request_id}: its input is pending but the previous step sampled none")
    return row


def token_sources(chunks: Sequence[ScheduledChunk], previous: Mapping[str, int]) -> list[int]:
    """The input source of every token of ``chunks``, in their order (``source_of``; a pending
    chunk is one token)."""
    return [s for c in chunks for s in (source_of(c, previous),) * c.num_tokens]


def pack_step(
    chunks: Sequence[ScheduledChunk], block_size: int, previous: Mapping[str, int] | None = None
) -> PackedStep:
    """Pack ``chunks`` for an eager step (decodes first, whatever their order; block tables as
    wide as the step's widest sequence). ``previous``: request id -> row of the tokens the
    previous step sampled (for ``pending`` chunks). Graph steps write their fixed layouts in
    place instead (``decode_graphs``)."""
    decodes = [c for c in chunks if c.single_token]
    prefills = [c for c in chunks if not c.single_token]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[str] = []
    sources = token_sources((*decodes, *prefills), previous or {})
    for c in (*decodes, *prefills):
        ids.extend(c.token_ids)
        for pos in range(c.start_pos, c.start_pos + c.num_tokens):
            positions.append(pos)
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
        if c.sample:
            sample_rows.append(len(ids) - 1)
            sample_ids.append(c.request_id)

    def tables(group: list[ScheduledChunk]) -> tuple[int, list[int]]:
        """The group's block tables, each cut to its sequence and padded to the widest."""
        rows = [c.block_table[: -(-(c.start_pos + c.num_tokens) // block_size)] for c in group]
        width = max((len(r) for r in rows), default=0)
        return width, [b for r in rows for b in (*r, *[0] * (width - len(r)))]

    d_width, dec_tables = tables(decodes)
    dec_lens = [c.start_pos + 1 for c in decodes]
    p_width, p_tables = tables(prefills)
    cu = [0]
    for c in prefills:
        cu.append(cu[-1] + c.num_tokens)
    prefill_part = (cu + [c.start_pos for c in prefills] + p_tables) if prefills else []
    values = ids + positions + slots + sources + sample_rows + dec_lens + dec_tables + prefill_part
    layout = StepLayout(len(ids), len(sample_rows), len(decodes), d_width, len(prefills), p_width)
    assert len(values) == layout.size
    max_q = max((c.num_tokens for c in prefills), default=0)
    return PackedStep(values, layout, sample_ids, max_q)


def unpack(
    buffer: torch.Tensor,
    layout: StepLayout,
    prefill_max_q: int,
    window: int,
    sample_all: bool,
) -> StepInputs:
    """Views of ``buffer`` (int32, on the model's device, at least ``layout.size`` long)."""
    at = 0

    def take(n: int) -> torch.Tensor:
        nonlocal at
        view = buffer[at : at + n]
        at += n
        return view

    t = layout.rows
    input_ids, positions, slots, sources = take(t), take(t), take(t), take(t)
    sample_rows = take(layout.samples)
    dec_lens = take(layout.decodes)
    dec_tables = take(layout.decodes * layout.decode_width).view(layout.decodes, layout.decode_width)
    p = layout.prefills
    if p:
        cu, starts = take(p + 1), take(p)
        p_tables = take(p * layout.prefill_width).view(p, layout.prefill_width)
    else:
        cu, starts, p_tables = take(0), take(0), take(0).view(0, 0)
    tuning = attention_tuning.current()
    meta = PagedMetadata(
        slot_mapping=slots,
        num_decodes=layout.decodes,
        decode_block_tables=dec_tables,
        decode_seq_lens=dec_lens,
        decode_splits=tuning.decode_splits,
        decode_min_split_tokens=tuning.decode_min_split_tokens,
        prefill_block_tables=p_tables,
        prefill_cu_q=cu,
        prefill_start=starts,
        prefill_max_q=prefill_max_q,
        window=window,
    )
    return StepInputs(input_ids, positions, sources, None if sample_all else sample_rows, meta)


def fill_pending(input_ids: torch.Tensor, sources: torch.Tensor, previous: torch.Tensor) -> None:
    """On the device, in place: each row with a source takes the previous step's sampled token
    at that source (``sources`` -1: the row keeps its id)."""
    taken = previous.index_select(0, sources.clamp(min=0).long()).to(input_ids.dtype)
    input_ids.copy_(torch.where(sources >= 0, taken, input_ids))


class Stager:
    """Moves packed steps to the device: one reused (pinned, on CUDA) host buffer, one
    non-blocking copy into a reused device buffer per step.

    Before the host buffer is refilled, the previous copy out of it must have finished: an event
    recorded after each copy is waited on (a no-op on CPU, where the copy is synchronous).
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._event: torch.cuda.Event | None = None
        self._host = self._new_host(capacity)
        self.device_buffer = torch.empty(capacity, dtype=torch.int32, device=device)

    def _new_host(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, pin_memory=self._pinned)

    def reserve(self, n: int) -> None:
        """Grow both buffers to hold ``n`` values (before capturing graphs over the device one)."""
        if n > self._host.numel():
            self._wait()
            size = max(n, 2 * self._host.numel())
            self._host = self._new_host(size)
            self.device_buffer = torch.empty(size, dtype=torch.int32, device=self.device)

    def _wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def stage(self, values: list[int]) -> torch.Tensor:
        """Copy ``values`` to the start of the device buffer; returns that buffer (whole)."""
        n = len(values)
        host = self.host(n)
        if n:
            host[:] = values
        return self.upload(n)

    def host(self, n: int) -> npt.NDArray[np.int32]:
        """The first ``n`` values of the host buffer, writable (the previous copy out of it has
        finished); keeps what was written there before, which a caller may update in part."""
        self.reserve(n)
        self._wait()
        return self._host[:n].numpy()

    def upload(self, n: int) -> torch.Tensor:
        """Copy the host buffer's first ``n`` values to the device buffer; returns it (whole)."""
        self.device_buffer[:n].copy_(self._host[:n], non_blocking=self._pinned)
        if self._pinned:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))
        return self.device_buffer
