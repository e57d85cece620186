"""The decode worker process: a ``WorkerHost`` with the decode engine (also the colocated one)."""

from __future__ import annotations

import time

from decode_worker.engine import DecodeEngine
from model_runtime.worker.host import WorkerHost
from model_runtime.worker.messages import KVTarget, WorkItem

RESERVE_RETRY_S = 0.005


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
        if none freed up in time (the router answers RESOURCE_EXHAUSTED)."""
        deadline = time.monotonic() + timeout_s
        while True:
            target: KVTarget | None = self.loop.call(self._decode.reserve, work, transfer_id)
            if target is not None or time.monotonic() >= deadline:
                return target
            time.sleep(RESERVE_RETRY_S)

    def start(self, request_id: str, first_token: int, cached_tokens: int) -> bool:
        return bool(self.loop.call(self._decode.start, request_id, first_token, cached_tokens))

    def add_local(self, work: WorkItem) -> None:
        """Prefill and decode ``work`` here (colocated deployments)."""
        self.loop.call(self._decode.add_local, work)
