"""Which KV heads move from which prefill rank to which decode rank (pure).

A prefill worker of degree ``p`` and a decode worker of degree ``d`` hold the same KV heads
split differently (``sharding.kv_heads_of``). Every decode rank receives exactly the heads it
holds, each once, straight from a prefill rank that holds it: nothing passes through rank 0
and no rank receives a head it does not keep. A ``Route`` is one such stream: a contiguous
range of heads, the same for every block and layer of the request, so a transfer's copies are
one per route, layer, K/V half and contiguous run of blocks — never one per token slot.

When the prefill side replicates a head (``Hkv < p``), the decode ranks that need it draw it
from different replicas in turn, spreading the reads over the ranks that hold it; no replica
is read twice for one receiving rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.model_runtime.parallel.sharding import kv_heads_of


@dataclass(frozen=True)
class Route:
    """Heads ``[src_head, src_head + count)`` of prefill rank ``src_rank``'s cache (local head
    indices) land in heads ``[dst_head, dst_head + count)`` of decode rank ``dst_rank``'s."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    count: int

    def is_whole(self, src_heads: int, dst_heads: int) -> bool:
        """The route moves both ranks' every head: whole blocks, no slicing."""
        return self.src_head == 0 and self.dst_head == 0 and self.count == src_heads == dst_heads


def _holders(num_kv_heads: int, tp: int, head: int) -> list[int]:
    """The ranks of a degree-``tp`` worker that hold global KV head ``head``, ascending."""
    out = []
    for r in range(tp):
        first, count = kv_heads_of(num_kv_heads, tp, r)
        if first <= head < first + count:
            out.append(r)
    return out


def routes(num_kv_heads: int, p: int, d: int) -> tuple[Route, ...]:
    """Every route from a degree-``p`` prefill worker to a degree-``d`` decode worker, ordered
    by decode rank then head. Degrees must be valid for ``num_kv_heads`` (``sharding``)."""
    out: list[Route] = []
    for dst in range(d):
        d_first, d_count = kv_heads_of(num_kv_heads, d, dst)
        for head in range(d_first, d_first + d_count):
            holders = _holders(num_kv_heads, p, head)
            src = holders[dst % len(holders)]
            s_first, _ = kv_heads_of(num_kv_heads, p, src)
            last = out[-1] if out else None
            if (
                last is not None
                and last.dst_rank == dst
                and last.src_rank == src
                and last.src_head + last.count == head - s_first
                and last.dst_head + last.count == head - d_first
            ):
                out[-1] = Route(src, dst, last.src_head, last.dst_head, last.count + 1)
            else:
                out.append(Route(src, dst, head - s_first, head - d_first, 1))
    return tuple(out)


def routes_to(num_kv_heads: int, p: int, d: int, dst_rank: int) -> tuple[Route, ...]:
    return tuple(r for r in routes(num_kv_heads, p, d) if r.dst_rank == dst_rank)
