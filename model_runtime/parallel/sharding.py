"""Which part of the model each rank of a tensor-parallel worker holds (pure).

Megatron-style: the fused QKV and gate/up projections are split by output (column-parallel),
O and down by input (row-parallel; one all-reduce each per layer), the embedding and the LM
head by vocabulary row. Attention heads are split whole: rank ``r`` of ``tp`` computes query
heads ``[r·Hq/tp, (r+1)·Hq/tp)`` and holds the KV heads those queries read. When the model has
fewer KV heads than ranks (grouped-query attention at a high degree), each KV head is
replicated on the ``tp / Hkv`` consecutive ranks whose query heads share it, so every rank
holds exactly one KV head and its cache is ``1 / Hkv`` of the full one, not ``1 / tp``.

A degree is valid when the query heads and the MLP width split evenly and the KV heads either
split evenly or divide the degree. The vocabulary need not split evenly: each rank holds
``ceil(V / tp)`` rows, the last rank fewer, and the gathered logits drop the padding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.model_runtime.config import ModelConfig
from pdserve.steptime.roofline import TP_DEGREES

DEGREES = TP_DEGREES


class ShardingError(ValueError):
    """The model cannot run at the requested degree; the message names the valid ones."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes sharding depends on (``ModelConfig`` has them; the planner's profiles too)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int


@dataclass(frozen=True)
class RankShard:
    """One rank's slices, as ``[start, start + count)`` ranges of the full model's."""

    rank: int
    tp: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_rows: int  # rows each rank's head holds, padding included (equal on every rank)

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1]


def why_invalid(shape: ModelShape, tp: int) -> str | None:
    """Why ``tp`` cannot shard ``shape``, or None when it can."""
    if tp < 1:
        return f"a tensor-parallel degree must be >= 1, got {tp}"
    if shape.num_heads % tp:
        return f"{shape.num_heads} attention heads do not split over {tp} ranks"
    kv = shape.num_kv_heads
    if kv % tp and tp % kv:
        return f"{kv} KV heads neither split over {tp} ranks nor divide {tp}"
    if shape.intermediate_size % tp:
        return f"the MLP width {shape.intermediate_size} does not split over {tp} ranks"
    if shape.vocab_size < tp:
        return f"a vocabulary of {shape.vocab_size} rows cannot split over {tp} ranks"
    return None


def valid_degrees(shape: ModelShape, candidates: tuple[int, ...] = DEGREES) -> tuple[int, ...]:
    return tuple(t for t in candidates if why_invalid(shape, t) is None)


def check_degree(shape: ModelShape, tp: int, what: str = "tensor-parallel degree") -> None:
    """Raise ``ShardingError`` naming the valid degrees when ``tp`` cannot shard ``shape``."""
    why = why_invalid(shape, tp)
    if why is not None:
        valid = ", ".join(map(str, valid_degrees(shape))) or "none of 1, 2, 4, 8"
        raise ShardingError(f"{what} {tp} is not valid for this model: {why}; valid degrees: {valid}")


def kv_heads_of(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """``(first, count)`` of the KV heads rank ``rank`` holds (replicated when Hkv < tp)."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return rank * per, per
    return rank // (tp // num_kv_heads), 1


def shard(shape: ModelShape, tp: int, rank: int) -> RankShard:
    check_degree(shape, tp)
    if not 0 <= rank < tp:
        raise ShardingError(f"rank {rank} outside 0..{tp - 1}")
    q = shape.num_heads // tp
    inter = shape.intermediate_size // tp
    rows = -(-shape.vocab_size // tp)
    v0 = min(rank * rows, shape.vocab_size)
    return RankShard(
        rank=rank,
        tp=tp,
        q_heads=(rank * q, q),
        kv_heads=kv_heads_of(shape.num_kv_heads, tp, rank),
        intermediate=(rank * inter, inter),
        vocab=(v0, min(rows, shape.vocab_size - v0)),
        vocab_rows=rows,
    )


def shape_of(config: ModelConfig) -> ModelShape:
    return ModelShape(config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size)


def rank_config(config: ModelConfig, s: RankShard) -> ModelConfig:
    """The model as one rank sees it: its heads and MLP width (the vocabulary stays whole: the
    gathered logits, the sampler and request validation see every token id)."""
    return replace(
        config, num_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads, intermediate_size=s.intermediate[1]
    )
