"""A rank other than 0 of a tensor-parallel worker: it runs each step rank 0 sends, on its own
shard, until told to stop or rank 0 is gone (its pipe reaches end-of-file).

``serve`` is the loop; a room that gives the ranks more to do (the worker's KV transport) passes
``on_op`` (answers an ``Op``) and ``on_layer_for`` (what to do as each layer of a step is
written: ship this rank's part of the step's layer-wise pushes).
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
from collections.abc import Callable

from pdserve.model_runtime.parallel import messages
from pdserve.model_runtime.parallel.ranks import RankArgs

log = logging.getLogger(__name__)

OnLayer = Callable[[int], None]


class Follows:
    """What a rank runs a step with (``ModelRunner.follow``)."""

    def follow(self, chunks: tuple[object, ...], on_layer: OnLayer | None) -> None: ...


def serve(
    conn: mpc.Connection,
    runner: Follows,
    on_op: Callable[[bytes], bytes] | None = None,
    on_layer_for: Callable[[tuple[str, ...]], OnLayer | None] | None = None,
) -> None:
    while True:
        try:
            frame = conn.recv_bytes(messages.MAX_FRAME_BYTES)
        except (EOFError, OSError):
            log.info("rank 0 is gone; this rank stops")
            return
        msg = messages.decode(frame)
        if isinstance(msg, messages.Stop):
            return
        if isinstance(msg, messages.Step):
            hook = on_layer_for(msg.layer_pushes) if on_layer_for is not None and msg.layer_pushes else None
            runner.follow(msg.chunks, hook)
        else:
            if on_op is None:
                raise messages.MessageError("this rank takes no ops")
            conn.send_bytes(on_op(msg.payload))


def main(args: RankArgs, conn: mpc.Connection) -> None:
    """A rank that only computes (a colocated worker's, the offline driver's)."""
    from pdserve.model_runtime.engine.runtime import build_rank_runtime

    rt = build_rank_runtime(args)
    try:
        serve(conn, rt.runner)  # type: ignore[arg-type]
    finally:
        rt.close()
