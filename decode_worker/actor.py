"""The decode worker process: a ``WorkerHost`` with the decode engine (also the colocated one)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.worker.host import WorkerHost
from pdserve.worker.loop import WorkerFailed
from pdserve.worker.messages import KVTarget, WorkItem


class DecodeWorker(WorkerHost):
    def _make_engine(self) -> DecodeEngine:
        return DecodeEngine(
            self.rt, self.transport, self.spec.engine.scheduler, self.spec.worker_id, self.spec.role
        )

    @property
    def _decode(self) -> DecodeEngine:
        assert isinstance(self.engine, DecodeEngine)
        return self.engine

    def queue_reservation(self, work: WorkItem, transfer_id: str, timeout_s: float) -> bool:
        """Ask for blocks for ``work``'s prompt KV, granted at once or when room frees within
        ``timeout_s`` (first come, first served); returns at once: True if granted or waiting
        (``await_reservation`` gives the outcome), False if refused now. Raises for a request
        this worker cannot serve. An ``abort`` after it returns reaches a waiting reservation."""
        outcome: Future[KVTarget | None] = self.loop.call(self._decode.reserve, work, transfer_id, timeout_s)
        return not outcome.done() or outcome.result() is not None

    def await_reservation(self, request_id: str, timeout_s: float) -> KVTarget | None:
        """The target of a queued reservation once granted; ``None`` if it expired, was
        aborted, or never was. Waits on the engine's own queue (it costs the loop nothing);
        callers run it apart from other commands (``pdserve.router.workers.WAITING_COMMANDS``)."""
        outcome: Future[KVTarget | None] = self.loop.call(self._decode.reservation, request_id)
        # The engine resolves it by the deadline; the margin covers one step in progress.
        give_up = time.monotonic() + max(0.0, timeout_s) + 30.0
        while True:
            try:
                return outcome.result(timeout=0.25)
            except FutureTimeout:
                if self.loop.error is not None:
                    raise WorkerFailed(f"worker loop stopped: {self.loop.error!r}") from None
                if time.monotonic() > give_up:
                    raise TimeoutError(f"reservation for {request_id!r} never resolved") from None

    def reserve(self, work: WorkItem, transfer_id: str, timeout_s: float) -> KVTarget | None:
        """``queue_reservation`` then ``await_reservation``, for callers that may block."""
        if not self.queue_reservation(work, transfer_id, timeout_s):
            return None
        return self.await_reservation(work.request_id, timeout_s)

    def kv_lost(self, request_id: str) -> bool:
        """The request's KV will not come from its prefill worker: recompute it here."""
        return bool(self.loop.call(self._decode.kv_lost, request_id))

    def start(self, request_id: str, first_token: int, cached_tokens: int) -> bool:
        return bool(self.loop.call(self._decode.start, request_id, first_token, cached_tokens))

    def add_local(self, work: WorkItem) -> None:
        """Prefill and decode ``work`` here (colocated deployments)."""
        self.loop.call(self._decode.add_local, work)
