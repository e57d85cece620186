"""A worker's KV transport across its ranks, and across workers of different TP degrees.

Every rank of a tensor-parallel worker has its own ``KVTransport`` over its own cache shard;
rank 0's is here, the others' run in their processes (``rank_main``) and take ``RankOps``
over the ranks' pipes. The engines keep speaking of one transfer per request: ``expect`` on a
decode worker and ``send`` on a prefill worker split it into one part per re-sharding route
(``model_runtime.parallel.reshard``), each run by the rank that owns its heads, straight to
the peer rank that keeps them — nothing passes through rank 0. ``poll`` folds the parts'
outcomes back into the transfer's (``kvtransfer.parts``).

A TP 1 worker talking to a TP 1 peer has one whole part under the transfer's own id, so the
wire carries exactly what it always did; a TP 1 worker talking to a TP 2 peer splits too.

Contract (as ``KVTransport``'s): it never allocates or frees blocks; after ``poll`` reports a
transfer, ``forget`` drops it, and each part's record is dropped on its rank once that part
ended as well. Rank 0's engine thread is the only caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdserve.kvtransfer.heads import HeadSlice, for_route
from pdserve.kvtransfer.parts import Part, PartTable, part_id
from pdserve.kvtransfer.states import Completions
from pdserve.model_runtime.parallel.group import RankLost
from pdserve.model_runtime.parallel.ranks import Ranks
from pdserve.model_runtime.parallel.reshard import routes
from pdserve.model_runtime.parallel.sharding import kv_heads_of
from pdserve.worker import rank_ops as ops


def _sliced(heads: HeadSlice | None) -> dict[str, HeadSlice]:
    """The slice argument, only when there is one: whole-block calls stay the calls every
    transport (the emulated link's too) always took."""
    return {} if heads is None else {"heads": heads}


class RankedTransport:
    def __init__(self, own: Any, ranks: Ranks | None, tp: int, num_kv_heads: int) -> None:
        self.own = own
        self.ranks = ranks
        self.tp = tp
        self.kv_heads = num_kv_heads
        self._table = PartTable()
        self._own_parts: dict[str, list[str]] = {}  # transfer id -> rank 0's part ids
        self._queued: list[tuple[int, ops.RankOp]] = []  # cancels and forgets, sent with the next call
        self._layer_pushes: list[str] = []  # other ranks' layer-wise parts sent since the last step
        self._outcomes = Completions()  # folded but not yet handed to ``poll``
        self._remote_live = 0  # parts the other ranks run and have not reported ended
        self.rank_addresses: tuple[str, ...] = ()
        # Every rank's counters as last heard (rank 0's: its own transport's ``stats``).
        self.rank_counters: list[ops.RankAnswer] = [ops.RankAnswer()] * (tp - 1)

    # -- what the other ranks are told -----------------------------------------------------------
    def _call(self, more: list[tuple[int, ops.RankOp]]) -> list[ops.RankAnswer]:
        batch, self._queued = self._queued + more, []
        if self.ranks is None or not batch:
            return []
        return [ops.decode_answer(a) for a in self.ranks.call(ops.encode_ops(batch))]

    def _heads(self, tp: int, rank: int) -> int:
        return kv_heads_of(self.kv_heads, tp, rank)[1]

    # -- receiver side ---------------------------------------------------------------------------
    def listen(self) -> str:
        address: str = self.own.listen()
        answers = self._call([(r, ops.Listen()) for r in range(1, self.tp)])
        self.rank_addresses = (address, *(a.address for a in answers)) if self.tp > 1 else ()
        return address

    @property
    def address(self) -> str:
        return str(self.own.address)

    @property
    def offers(self) -> list[str]:
        return list(self.own.offers)

    @property
    def stats(self) -> Any:
        return self.own.stats

    def expect(
        self, transfer_id: str, dst_blocks: Sequence[int], source_tp: int = 1, lease_s: float | None = None
    ) -> None:
        """Accept the transfer into ``dst_blocks`` on every rank, from a worker of degree
        ``source_tp``: each rank expects one part per prefill rank that holds some of its heads."""
        whole = source_tp == 1 and self.tp == 1
        rs = routes(self.kv_heads, source_tp, self.tp)
        pids = [part_id(transfer_id, r.src_rank, r.dst_rank, whole) for r in rs]
        self._table.add(
            transfer_id, [Part(r.dst_rank, p) for r, p in zip(rs, pids, strict=True)], receiving=True
        )
        remote: list[tuple[int, ops.RankOp]] = []
        for r, pid in zip(rs, pids, strict=True):
            heads = for_route(r, self._heads(source_tp, r.src_rank), self._heads(self.tp, r.dst_rank))
            if r.dst_rank == 0:
                self.own.expect(pid, dst_blocks, lease_s, **_sliced(heads))
                self._own_parts.setdefault(transfer_id, []).append(pid)
            else:
                start, count = (heads.dst_start, heads.count) if heads else (0, 0)
                remote.append(
                    (r.dst_rank, ops.ExpectPart(pid, tuple(dst_blocks), start, count, heads is None))
                )
        self._remote_live += len(remote)
        self._call(remote)

    # -- sender side -----------------------------------------------------------------------------
    def send(
        self,
        transfer_id: str,
        peer: str,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        layerwise: bool = False,
        timeout_s: float | None = None,
        peer_offers: Sequence[str] | None = None,
        peer_ranks: Sequence[str] = (),
    ) -> None:
        """Push to a worker whose ranks listen at ``peer_ranks`` (its degree is their count;
        empty: one rank, at ``peer``). Each of this worker's ranks sends the heads it holds to
        the peer ranks that keep them."""
        d = len(peer_ranks) or 1
        addresses = tuple(peer_ranks) or (peer,)
        whole = d == 1 and self.tp == 1
        rs = routes(self.kv_heads, self.tp, d)
        pids = [part_id(transfer_id, r.src_rank, r.dst_rank, whole) for r in rs]
        self._table.add(
            transfer_id, [Part(r.src_rank, p) for r, p in zip(rs, pids, strict=True)], receiving=False
        )
        remote: list[tuple[int, ops.RankOp]] = []
        for r, pid in zip(rs, pids, strict=True):
            heads = for_route(r, self._heads(self.tp, r.src_rank), self._heads(d, r.dst_rank))
            if r.src_rank == 0:
                self.own.send(
                    pid, addresses[r.dst_rank], src_blocks, dst_blocks, layerwise, timeout_s, peer_offers,
                    **_sliced(heads),
                )  # fmt: skip
                self._own_parts.setdefault(transfer_id, []).append(pid)
                continue
            src_head, dst_head, count = (
                (heads.src_start, heads.dst_start, heads.count) if heads else (0, 0, 0)
            )
            offers = tuple(peer_offers or ())
            remote.append((r.src_rank, ops.SendPart(
                pid, addresses[r.dst_rank], tuple(src_blocks), tuple(dst_blocks), layerwise, offers,
                src_head, dst_head, count, heads is None,
            )))  # fmt: skip
            if layerwise:
                self._layer_pushes.append(pid)
        self._remote_live += len(remote)
        self._call(remote)

    def layer_ready(self, transfer_id: str, layer: int) -> None:
        for pid in self._own_parts.get(transfer_id, ()):
            self.own.layer_ready(pid, layer)

    def take_layer_pushes(self) -> tuple[str, ...]:
        """The other ranks' layer-wise parts sent since the last step: the next step's ranks
        ship their layers as they compute them (``ModelRunner.layer_pushes``)."""
        out, self._layer_pushes = tuple(self._layer_pushes), []
        return out

    # -- both ------------------------------------------------------------------------------------
    def _route_op(self, part: Part, own: Callable[[str], None], op: ops.RankOp) -> None:
        if part.rank == 0:
            own(part.id)
        else:
            self._queued.append((part.rank, op))

    def cancel(self, transfer_id: str) -> None:
        for p in self._table.live_parts(transfer_id):
            self._route_op(p, self.own.cancel, ops.CancelPart(p.id))
        self._call([])

    def _gather(self) -> tuple[list[Completions], int]:
        """The other ranks' part outcomes since the last ask, and their record count."""
        answers = self._call([(r, ops.Poll()) for r in range(1, self.tp)])
        if answers:
            self.rank_counters = answers
        comps = [a.completions for a in answers]
        self._remote_live -= sum(
            len(c.finished_sending) + len(c.finished_receiving) + len(c.failed) for c in comps
        )
        return comps, sum(a.records for a in answers)

    def _fold(self, comps: list[Completions]) -> None:
        out, forgettable = self._table.fold(comps)
        for tid in out.failed:  # one part failed: the transfer has, so the others stop too
            self.cancel(tid)
        for p in forgettable:
            self._route_op(p, self.own.forget, ops.ForgetPart(p.id))
        o = self._outcomes
        o.finished_sending |= out.finished_sending
        o.finished_receiving |= out.finished_receiving
        o.failed.update(out.failed)

    def poll(self) -> Completions:
        comps = [self.own.poll()]
        if self._remote_live or self._queued:  # an idle worker's poll asks no other rank
            comps += self._gather()[0]
        self._fold(comps)
        out, self._outcomes = self._outcomes, Completions()
        return out

    def forget(self, transfer_id: str) -> None:
        self._own_parts.pop(transfer_id, None)
        for p in self._table.forget(transfer_id):
            self._route_op(p, self.own.forget, ops.ForgetPart(p.id))

    @property
    def settling(self) -> bool:
        return self._table.settling

    def on_completion(self, callback: Callable[[], None]) -> None:
        self.own.on_completion(callback)

    def num_records(self) -> int:
        """Transfers any rank still keeps a record of (a fresh count from every rank)."""
        comps, records = self._gather() if self.tp > 1 else ([], 0)
        self._fold([self.own.poll(), *comps])
        if self._queued:  # the forgets that fold just queued, delivered and counted
            comps, records = self._gather()
            self._fold(comps)
        return int(self.own.num_records()) + len(self._table) + records

    def close(self) -> None:
        try:
            self._call([(r, ops.Close()) for r in range(1, self.tp)])
        except RankLost:  # a rank that is gone has nothing left to close
            pass
        finally:
            self.own.close()
