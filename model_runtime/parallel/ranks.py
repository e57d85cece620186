"""Rank 0's side of a tensor-parallel worker: it starts the other ranks, sends each its
messages and reads their answers.

The other ranks are child processes of rank 0 (from a fork server), each on its own device,
joined to rank 0 by a pipe for messages (``messages``) and by the worker's process group for
tensors. They live and die with rank 0: a rank whose pipe reaches end-of-file (rank 0 is gone)
exits at once, and rank 0 stops them all when it stops. A rank that dies is seen at once
(``watch``), and makes rank 0's next send, read or collective raise ``RankLost``: the worker
fails as one, its requests move to other workers, and nothing waits on a rank that is gone.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.model_runtime.parallel import messages
from pdserve.model_runtime.parallel.group import RankLost

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


def _context(entry_module: str) -> Any:
    """Ranks start from a fork server that imported torch and pdserve once: a fresh
    interpreter per rank would import them again (seconds each), and a fork of rank 0 itself
    would copy a process with live threads (torch's pools, the worker's own). Its children are
    as clean as spawned ones."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", entry_module])
    return ctx


@dataclass(frozen=True)
class RankArgs:
    """What a child rank starts from; ``config`` is the worker's (the child's shard follows
    from ``rank``), ``extra`` the room's own settings (e.g. the KV transport's)."""

    rank: int
    size: int
    store: tuple[str, int]
    config: Any
    extra: Any = None
    threads: int = 0  # a CPU rank's torch threads: rank 0's own count (0: the default)


class Ranks:
    """Ranks 1..size-1 of one worker, seen from rank 0."""

    def __init__(
        self, entry: Callable[[RankArgs, mpc.Connection], None], args: list[RankArgs], answer_timeout_s: float
    ) -> None:
        ctx = _context(entry.__module__)
        self.answer_timeout_s = answer_timeout_s
        self._conns: list[mpc.Connection] = []
        self._procs: list[Any] = []
        self._stopping = False
        for a in args:
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=entry, args=(a, theirs), name=f"pdserve-rank-{a.rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def watch(self, on_lost: Callable[[int], None]) -> None:
        """Call ``on_lost(rank)`` (from a thread of its own) as soon as a rank's process ends
        other than by ``stop``: an idle worker learns of a dead rank at once, not at its next
        step."""
        sentinels = [p.sentinel for p in self._procs]

        def run() -> None:
            ended = mpc.wait(sentinels)
            if not self._stopping:
                on_lost(1 + sentinels.index(ended[0]))

        threading.Thread(target=run, name="rank-watch", daemon=True).start()

    def send(self, msg: messages.Message) -> None:
        frame = messages.encode(msg)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(frame)
            except (OSError, ValueError) as e:
                raise RankLost(f"rank {rank} is gone ({e})") from None

    def answers(self) -> list[bytes]:
        """Each rank's answer to the last ``Op``, in rank order."""
        out = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                if not conn.poll(self.answer_timeout_s):
                    raise RankLost(f"rank {rank} did not answer within {self.answer_timeout_s:.0f}s")
                out.append(conn.recv_bytes(messages.MAX_FRAME_BYTES))
            except (OSError, EOFError) as e:
                raise RankLost(f"rank {rank} is gone ({e})") from None
        return out

    def call(self, payload: bytes) -> list[bytes]:
        self.send(messages.Op(payload))
        return self.answers()

    def stop(self) -> None:
        """Stop every rank: a ``Stop`` and a grace period, then a kill for any that lingers."""
        self._stopping = True
        with contextlib.suppress(RankLost):
            self.send(messages.Stop())
        for p in self._procs:
            p.join(STOP_GRACE_S)
            if p.is_alive():
                p.kill()
                p.join(STOP_GRACE_S)
        for c in self._conns:
            c.close()
