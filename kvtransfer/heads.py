"""Which KV heads a transfer moves, and which peers may exchange them (pure Python).

A tensor-parallel worker's rank holds only some of the model's KV heads, so two ranks of workers
of different degrees hold caches that differ in ``num_kv_heads`` alone. Such peers connect, and
each transfer between them names a ``HeadSlice``: a contiguous range of the sender's heads
written into a contiguous range of the receiver's, in every block and layer it moves. Without a
slice a transfer moves whole blocks, which only caches with the same heads can do: anything else
would be a silent partial write, so it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.model_runtime.parallel.reshard import Route

MAX_KV_HEADS = 1 << 12  # KV heads of one cache: a bound on what a head slice may name
# The layout fields two peers must agree on; ``num_kv_heads`` may differ (tensor-parallel ranks).
SHARED_LAYOUT_FIELDS = ("num_layers", "block_size", "head_dim", "dtype", "order")


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[src_start, src_start + count)`` of the sender's cache (its local head indices)
    land in heads ``[dst_start, dst_start + count)`` of the receiver's."""

    src_start: int
    dst_start: int
    count: int

    def __post_init__(self) -> None:
        for name in ("src_start", "dst_start", "count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_KV_HEADS:
                raise ValueError(f"HeadSlice.{name}: an integer in 0..{MAX_KV_HEADS - 1}, got {value!r}")
        if self.count < 1:
            raise ValueError("a head slice moves at least one head")

    def to_wire(self) -> list[int]:
        return [self.src_start, self.dst_start, self.count]

    @staticmethod
    def from_wire(value: list[int] | None) -> HeadSlice | None:
        """The ``begin`` frame's ``heads`` field (already checked by ``wire``), or None."""
        return None if value is None else HeadSlice(*value)

    def same_destination(self, other: HeadSlice) -> bool:
        """Whether both fill the same heads of the receiver (which of the sender's heads feed
        them is the sender's business)."""
        return (self.dst_start, self.count) == (other.dst_start, other.count)


def for_route(route: Route, src_heads: int, dst_heads: int) -> HeadSlice | None:
    """What a transfer along ``route`` names, between ranks whose caches hold ``src_heads`` and
    ``dst_heads`` KV heads: None where it moves both ranks' every head (whole blocks)."""
    if route.is_whole(src_heads, dst_heads):
        return None
    return HeadSlice(route.src_head, route.dst_head, route.count)


def heads_of(layout: Any) -> int | None:
    """``num_kv_heads`` of a peer's layout map, if it is a sane one."""
    if not isinstance(layout, Mapping):
        return None
    n = layout.get("num_kv_heads")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_KV_HEADS:
        return None
    return n


def layout_mismatch(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> str | None:
    """Why a peer with layout ``theirs`` cannot exchange KV with us at all, or None. Head counts
    may differ (each transfer then names its slice); every other field must be equal."""
    if set(theirs) != set(ours) or heads_of(theirs) is None:
        return f"layout mismatch: ours {dict(ours)}, theirs {dict(theirs)}"
    differ = [f for f in SHARED_LAYOUT_FIELDS if theirs.get(f) != ours.get(f)]
    if differ:
        return f"layout mismatch in {', '.join(differ)}: ours {dict(ours)}, theirs {dict(theirs)}"
    return None


def transfer_problem(heads: HeadSlice | None, src_heads: int, dst_heads: int) -> str | None:
    """Why a transfer with ``heads`` between caches holding ``src_heads`` and ``dst_heads`` KV
    heads cannot go ahead, or None."""
    if heads is None:
        if src_heads != dst_heads:
            return (
                f"the caches hold {src_heads} and {dst_heads} KV heads: "
                "a transfer between them must name a head slice"
            )
        return None
    if heads.src_start + heads.count > src_heads:
        return f"head slice {heads} reads past the sender's {src_heads} KV heads"
    if heads.dst_start + heads.count > dst_heads:
        return f"head slice {heads} writes past the receiver's {dst_heads} KV heads"
    return None
