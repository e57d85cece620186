"""The prefill worker process: a ``WorkerHost`` with the prefill engine and one command."""

from __future__ import annotations

from concurrent.futures import Future

from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.worker.commands import Answer, Command, Prefill, SetTarget
from pdserve.worker.host import WorkerHost
from pdserve.worker.messages import KVTarget, WorkItem


class PrefillWorker(WorkerHost):
    def _make_engine(self) -> PrefillEngine:
        assert self.transport is not None
        return PrefillEngine(self.rt, self.transport, self.spec.engine.scheduler, self.spec.worker_id)

    @property
    def _prefill(self) -> PrefillEngine:
        assert isinstance(self.engine, PrefillEngine)
        return self.engine

    def _execute_role(self, cmd: Command) -> Future[Answer]:
        if isinstance(cmd, Prefill):
            return self.loop.submit(self._prefill.add, cmd.work, cmd.target)
        if isinstance(cmd, SetTarget):
            return self.loop.submit(self._prefill.set_target, cmd.request_id, cmd.target)
        return super()._execute_role(cmd)

    def prefill(self, work: WorkItem, target: KVTarget | None = None) -> None:
        """Queue ``work``; its first token comes back through ``collect`` (``prefilled``), its KV
        goes to ``target`` (or to the one ``set_target`` names later). Raises
        ``InvalidRequestError`` for a request this worker cannot serve."""
        self.run(Prefill(work, target))

    def set_target(self, request_id: str, target: KVTarget) -> bool:
        return bool(self.run(SetTarget(request_id, target)))
