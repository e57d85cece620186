"""The prefill worker process: a ``WorkerHost`` with the prefill engine and one command."""

from __future__ import annotations

from model_runtime.worker.host import WorkerHost
from model_runtime.worker.messages import KVTarget, WorkItem
from prefill_worker.engine import PrefillEngine


class PrefillWorker(WorkerHost):
    def _make_engine(self) -> PrefillEngine:
        assert self.transport is not None
        return PrefillEngine(self.rt, self.transport, self.spec.engine.scheduler, self.spec.worker_id)

    def prefill(self, work: WorkItem, target: KVTarget) -> None:
        """Queue ``work``; its first token comes back through ``collect`` (``prefilled``), its KV
        goes to ``target``. Raises ``InvalidRequestError`` for a request this worker cannot serve."""
        engine = self.engine
        assert isinstance(engine, PrefillEngine)
        self.loop.call(engine.add, work, target)
