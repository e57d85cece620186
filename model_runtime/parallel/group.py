"""The collectives of one tensor-parallel worker's ranks (torch.distributed).

Each worker has its own group, made directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over
a ``TCPStore`` that rank 0 serves on loopback): no process-global default group, so one
process can host ranks of several workers in turn (tests) and a worker's group never meets
another's. Gloo on CPU — TP runs for real in CI — and NCCL on GPUs.

Every collective waits at most ``timeout_s``: a rank that died or stalls makes its peers'
next collective raise ``RankLost`` instead of hanging, and the worker fails as a whole.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Protocol

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 30.0
_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]  # (exported at run time, not in the stubs)


class RankLost(RuntimeError):
    """A collective failed or timed out: a rank of this worker is gone or stuck."""


class Collectives(Protocol):
    """What the model's forward needs from its ranks."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place."""
        ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (equal shapes), concatenated along the last dimension."""
        ...

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's ``t`` into every rank's, in place."""
        ...


def serve_store(host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Rank 0's rendezvous store on a free port of ``host`` (``store.port``)."""
    return _TCPStore(
        host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


class TPGroup:
    def __init__(
        self,
        rank: int,
        size: int,
        store: Any,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        join_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Join the group (blocks until every rank joined). Rank 0 passes the store it serves
        (``serve_store``); the others its ``(host, port)``. ``join_timeout_s`` bounds waits on
        the store (joining, ``agree``), ``timeout_s`` each collective."""
        self.rank, self.size, self.device = rank, size, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        if isinstance(store, tuple):
            store = _TCPStore(
                store[0], store[1], None, False, timeout=datetime.timedelta(seconds=join_timeout_s)
            )
        self._store = store
        try:
            if device.type == "cuda":
                self._pg: Any = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
            else:
                self._pg = dist.ProcessGroupGloo(store, rank, size, self.timeout)
        except RuntimeError as e:
            raise RankLost(f"rank {rank} of {size} could not join its group: {e}") from None

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            if not work.wait(self.timeout):
                raise RankLost(f"{what} timed out after {self.timeout.total_seconds():.0f}s")
        except RuntimeError as e:  # gloo: a peer closed its connection; NCCL: a watchdog abort
            raise RankLost(f"{what} failed on rank {self.rank}: {e}") from None

    def all_reduce(self, t: torch.Tensor) -> None:
        self._wait(self._pg.allreduce([t]), "all_reduce")

    def agree(self, key: str, value: int) -> list[int]:
        """Every rank's ``value`` for ``key``, in rank order, through the store: a rendezvous that
        waits as long as joining may (ranks that load large shards arrive minutes apart)."""
        self._store.set(f"agree/{key}/{self.rank}", str(value))
        try:
            return [int(self._store.get(f"agree/{key}/{r}")) for r in range(self.size)]
        except RuntimeError as e:
            raise RankLost(f"ranks did not agree on {key}: {e}") from None

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self._pg.allgather([parts], [t]), "all_gather")
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self._pg.broadcast([t], opts), "broadcast")

    def close(self) -> None:
        """Leave the group; later collectives of the others fail rather than wait."""
        shutdown = getattr(self._pg, "shutdown", None)
        if shutdown is not None:
            with contextlib.suppress(RuntimeError):
                shutdown()
