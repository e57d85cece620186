"""The decode worker process: a ``WorkerHost`` with the decode engine (also the colocated one)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.model_runtime.worker.host import WorkerHost
from pdserve.model_runtime.worker.loop import WorkerFailed
from pdserve.model_runtime.worker.messages import KVTarget, WorkItem

# Ray runs ``reserve`` calls in a concurrency group of their own (``pdserve.deploy.ray_pools``): each
# may wait for room for seconds, and must never hold a thread other commands need.
RESERVE_GROUP = "reserve"


class DecodeWorker(WorkerHost):
    def _make_engine(self) -> DecodeEngine:
        return DecodeEngine(
            self.rt, self.transport, self.spec.engine.scheduler, self.spec.worker_id, self.spec.role
        )

    @property
    def _decode(self) -> DecodeEngine:
        assert isinstance(self.engine, DecodeEngine)
        return self.engine

    def reserve(self, work: WorkItem, transfer_id: str, timeout_s: float) -> KVTarget | None:
        """Reserve blocks for ``work``'s prompt KV, waiting up to ``timeout_s`` for room; ``None``
        if none freed up in time or the request was aborted meanwhile (the router answers
        RESOURCE_EXHAUSTED). The wait is on the engine's own queue of reservations, served
        between steps: it costs the loop nothing while it waits."""
        pending: Future[KVTarget | None] = self.loop.call(self._decode.reserve, work, transfer_id, timeout_s)
        # The engine resolves it by the deadline; the margin covers one step in progress.
        give_up = time.monotonic() + max(0.0, timeout_s) + 30.0
        while True:
            try:
                return pending.result(timeout=0.25)
            except FutureTimeout:
                if self.loop.error is not None:
                    raise WorkerFailed(f"worker loop stopped: {self.loop.error!r}") from None
                if time.monotonic() > give_up:
                    raise TimeoutError(f"reservation for {work.request_id!r} never resolved") from None

    def kv_lost(self, request_id: str) -> bool:
        """The request's KV will not come from its prefill worker: recompute it here."""
        return bool(self.loop.call(self._decode.kv_lost, request_id))

    def start(self, request_id: str, first_token: int, cached_tokens: int) -> bool:
        return bool(self.loop.call(self._decode.start, request_id, first_token, cached_tokens))

    def add_local(self, work: WorkItem) -> None:
        """Prefill and decode ``work`` here (colocated deployments)."""
        self.loop.call(self._decode.add_local, work)
