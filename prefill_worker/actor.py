"""The prefill role of a worker process: the prefill engine and its commands."""

from __future__ import annotations

from typing import ClassVar

from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.prefill_worker.handlers import PREFILL_HANDLERS
from pdserve.worker.commands import Prefill, SetTarget, Withdraw
from pdserve.worker.host import Role, WorkerHost
from pdserve.worker.messages import KVTarget, WorkerRole, WorkItem


def _engine(host: WorkerHost) -> PrefillEngine:
    assert host.transport is not None
    return PrefillEngine(host.rt, host.transport, host.spec.engine.scheduler, host.spec.worker_id)


PREFILL = Role(make_engine=_engine, handlers=PREFILL_HANDLERS, transport=True, listens=False)


class PrefillWorker(WorkerHost):
    ROLES: ClassVar = {WorkerRole.PREFILL: PREFILL}

    # -- the same commands, in process (tests, tools): one path with the channel's ----------
    def prefill(self, work: WorkItem, target: KVTarget | None = None) -> None:
        """Queue ``work``; its first token comes back through ``collect`` (``prefilled``), its KV
        goes to ``target`` (or to the one ``set_target`` names later). Raises
        ``InvalidRequestError`` for a request this worker cannot serve."""
        self.run(Prefill(work, target))

    def set_target(self, request_id: str, target: KVTarget) -> bool:
        return bool(self.run(SetTarget(request_id, target)))

    def withdraw(self, request_id: str) -> bool:
        """Take back a prompt that has not started; False if it started or is not here."""
        return bool(self.run(Withdraw(request_id)))
