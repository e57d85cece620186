"""Turn a schedule plan into the index tensors one forward pass needs (torch, no model math)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.model_runtime.model.attention import AttentionMetadata, PrefillSeq
from pdserve.model_runtime.scheduler.plan import ScheduledChunk


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    sample_ids: list[str]  # request id of each sampled row, in row order


def build_batch(
    chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device, sliding_window: int | None
) -> ForwardBatch:
    ids: list[int] = []
    positions: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[str] = []
    decode_rows: list[int] = []
    decode_tables: list[tuple[int, ...]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSeq] = []

    def as_long(x: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    for c in chunks:
        row0 = len(ids)
        ids.extend(c.token_ids)
        for pos in range(c.start_pos, c.start_pos + c.num_tokens):
            positions.append(pos)
            slot_blocks.append(c.block_table[pos // block_size])
            slot_offsets.append(pos % block_size)
        if c.sample:
            sample_rows.append(len(ids) - 1)
            sample_ids.append(c.request_id)
        end_pos = c.start_pos + c.num_tokens
        if c.single_token:
            decode_rows.append(row0)
            decode_tables.append(c.block_table[: -(-end_pos // block_size)])
            decode_lens.append(end_pos)
            continue
        windowed = sliding_window is not None and end_pos > sliding_window
        mask = None
        cached = None
        if c.start_pos > 0 or windowed:
            q_pos = torch.arange(c.start_pos, end_pos, device=device).unsqueeze(1)
            k_pos = torch.arange(end_pos, device=device).unsqueeze(0)
            mask = k_pos <= q_pos
            if windowed:
                assert sliding_window is not None
                mask &= k_pos > q_pos - sliding_window
        if c.start_pos > 0:
            cached = as_long(c.block_table[: -(-c.start_pos // block_size)])
        prefills.append(PrefillSeq(row0, row0 + c.num_tokens, c.start_pos, cached, mask))

    decode_rows_t = decode_tables_t = decode_mask = None
    contiguous = decode_rows == list(range(len(decode_rows)))
    if decode_rows:
        width = max(len(t) for t in decode_tables)
        decode_tables_t = as_long([list(t) + [0] * (width - len(t)) for t in decode_tables])
        lens = as_long(decode_lens).unsqueeze(1)
        k_pos = torch.arange(width * block_size, device=device).unsqueeze(0)
        allowed = k_pos < lens
        if sliding_window is not None:
            allowed &= k_pos > lens - 1 - sliding_window
        decode_mask = allowed[:, None, None, :]
        decode_rows_t = as_long(decode_rows)
    meta = AttentionMetadata(
        slot_blocks=as_long(slot_blocks),
        slot_offsets=as_long(slot_offsets),
        decode_rows=decode_rows_t,
        decode_block_tables=decode_tables_t,
        decode_mask=decode_mask,
        decode_contiguous=contiguous,
        prefills=prefills,
        block_size=block_size,
    )
    return ForwardBatch(as_long(ids), as_long(positions), meta, as_long(sample_rows), sample_ids)
