"""Rank > 0 of a tensor-parallel worker: its shard of the model and its own KV transport.

Started by rank 0 (``model_runtime.parallel.ranks``) with the worker's settings; it runs each
step rank 0 sends and each ``RankOps`` message's ops addressed to it, on its own transport, and
exits when rank 0 stops it or is gone.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
from dataclasses import dataclass
from typing import Any

from pdserve.kvtransfer.config import TransportConfig
from pdserve.kvtransfer.heads import HeadSlice
from pdserve.kvtransfer.states import Completions
from pdserve.kvtransfer.tls import InternalTls
from pdserve.kvtransfer.transport import KVTransport
from pdserve.model_runtime.engine.runtime import build_rank_runtime
from pdserve.model_runtime.parallel import follower
from pdserve.model_runtime.parallel.ranks import RankArgs
from pdserve.worker import rank_ops as ops

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankTransportSettings:
    """What a rank's KV transport is opened with (the worker's own settings)."""

    secret: bytes
    config: TransportConfig
    shared_cache: bool  # the cache lives in /dev/shm so same-host senders write into it
    tls: InternalTls | None = None


class RankTransport:
    """Runs rank 0's ops on this rank's transport."""

    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport
        self.layerwise: set[str] = set()

    def handle(self, frame: bytes, rank: int) -> bytes:
        t = self.transport
        address = ""
        mine = ops.decode_ops(frame, rank)
        done = Completions()
        for op in mine:
            if isinstance(op, ops.Listen):
                address = t.listen()
            elif isinstance(op, ops.ExpectPart):
                heads = None if op.whole else HeadSlice(0, op.dst_head, op.count)
                t.expect(op.part_id, op.blocks, heads=heads)
            elif isinstance(op, ops.SendPart):
                heads = None if op.whole else HeadSlice(op.src_head, op.dst_head, op.count)
                t.send(
                    op.part_id, op.peer, op.src_blocks, op.dst_blocks, op.layerwise,
                    peer_offers=op.offers or None, heads=heads,
                )  # fmt: skip
                if op.layerwise:
                    self.layerwise.add(op.part_id)
            elif isinstance(op, ops.CancelPart):
                t.cancel(op.part_id)
            elif isinstance(op, ops.ForgetPart):
                t.forget(op.part_id)
                self.layerwise.discard(op.part_id)
            elif isinstance(op, ops.Poll):
                done = t.poll()
            elif isinstance(op, ops.Close):
                t.close()
        return ops.encode_answer(
            ops.RankAnswer(
                address=address,
                completions=done,
                records=t.num_records(),
                bytes_sent=t.stats.bytes_sent,
                bytes_received=t.stats.bytes_received,
                descriptors_sent=t.stats.descriptors_sent,
                descriptors_received=t.stats.descriptors_received,
            )
        )

    def on_layer_for(self, pushes: tuple[str, ...]) -> follower.OnLayer | None:
        mine = [p for p in pushes if p in self.layerwise]
        if not mine:
            return None

        def on_layer(i: int) -> None:
            for pid in mine:
                self.transport.layer_ready(pid, i)

        return on_layer


def main(args: RankArgs, conn: mpc.Connection) -> None:
    settings: RankTransportSettings = args.extra
    allocate: Any = None
    shm_paths: list[Any] = []
    if settings.shared_cache:
        from pdserve.kvtransfer.datapath import allocate_shared_kv_cache

        def allocate(shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
            t, path = allocate_shared_kv_cache(shape, dtype)
            shm_paths.append(path)
            return t

    rt = build_rank_runtime(args, allocate)
    transport = KVTransport(
        rt.kv_cache, settings.secret, settings.config, shm_paths[0] if shm_paths else None, settings.tls
    )
    ranked = RankTransport(transport)
    try:
        follower.serve(conn, rt.runner, lambda frame: ranked.handle(frame, args.rank), ranked.on_layer_for)  # type: ignore[arg-type]
    finally:
        transport.close()
        rt.close()
