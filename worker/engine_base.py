"""What both role engines share: their load report and the leak check run when idle."""

from __future__ import annotations

from typing import Any

from pdserve.model_runtime.kv_cache.manager import KVCacheManager, check_idle
from pdserve.worker.messages import TransferCounters, WorkerLoad, WorkerRole

# Transfers in flight: the transport wakes the loop on every completion; this poll only bounds
# the delay should a wake-up ever be missed.
PENDING_IO_POLL_S = 0.02


class RoleEngineBase:
    worker_id: str
    role: WorkerRole
    kv: KVCacheManager
    transport: Any  # a KVTransport, or None (colocated); typed loosely to keep this module pure

    @property
    def idle(self) -> bool:
        """No request held at all (so no block may be in use)."""
        raise NotImplementedError

    def io_wait_s(self) -> float:
        """With transfers in flight and nothing to compute, how long the loop may sleep before
        stepping again (a transfer completion wakes it earlier)."""
        return PENDING_IO_POLL_S

    def counts(self) -> tuple[int, int]:
        """(running, waiting) as the routing policy should see them."""
        raise NotImplementedError

    def load(self, address: str = "") -> WorkerLoad:
        s = self.kv.stats()
        running, waiting = self.counts()
        return WorkerLoad(
            self.worker_id,
            self.role,
            address,
            running=running,
            waiting=waiting,
            kv_total=s.total,
            kv_free=s.free + s.cached,  # what allocation can use: cached blocks are evictable
            kv_cached=s.cached,
            transfers=self._transfer_counters(),
        )

    def _transfer_counters(self) -> TransferCounters | None:
        stats = getattr(self.transport, "stats", None)
        if stats is None:
            return None
        sent = self.role is WorkerRole.PREFILL
        return TransferCounters(
            seconds=stats.send_seconds if sent else stats.receive_seconds,
            count=stats.transfers_sent if sent else stats.transfers_received,
            failures=tuple(sorted(stats.failures.items())),
            by_backend=tuple(sorted((stats.sent_by_backend if sent else stats.received_by_backend).items())),
        )

    def on_stop(self) -> None:
        """The step loop stopped (shutdown or failure): resolve whatever callers wait on."""

    def request_state(self) -> dict[str, int]:
        """Sizes of every per-request map this engine, its KV manager and its transport keep;
        all 0 whenever the engine is idle."""
        raise NotImplementedError

    def _transport_state(self) -> dict[str, int]:
        records = getattr(self.transport, "num_records", None)
        return {} if records is None else {"transfer_records": records()}

    def check_integrity(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent, or blocks or per-request state
        leaked while idle."""
        idle = self.idle
        check_idle(self.kv, idle, self.request_state() if idle else {})
