"""What both role engines share: their load report and the leak check run when idle."""

from __future__ import annotations

from model_runtime.kv_cache.manager import KVCacheManager
from model_runtime.worker.messages import WorkerLoad, WorkerRole


class RoleEngineBase:
    worker_id: str
    role: WorkerRole
    kv: KVCacheManager

    @property
    def idle(self) -> bool:
        """No request held at all (so no block may be in use)."""
        raise NotImplementedError

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
        )

    def check_integrity(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent or blocks leaked while idle."""
        stats = self.kv.check_integrity()
        if self.idle and stats.used:
            raise AssertionError(f"{stats.used} KV blocks still used with no request in flight")
