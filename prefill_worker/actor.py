"""The prefill role of a worker process: the prefill engine and its commands."""

from __future__ import annotations

from concurrent.futures import Future
from typing import ClassVar

from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.worker.commands import Answer, Command, Prefill, SetTarget, Withdraw
from pdserve.worker.host import Role, WorkerHost
from pdserve.worker.loop import RoleEngine
from pdserve.worker.messages import KVTarget, WorkerRole, WorkItem


def _engine(host: WorkerHost) -> PrefillEngine:
    assert host.transport is not None
    return PrefillEngine(host.rt, host.transport, host.spec.engine.scheduler, host.spec.worker_id)


def _execute(host: WorkerHost, eng: RoleEngine, cmd: Command) -> Future[Answer] | None:
    assert isinstance(eng, PrefillEngine)
    if isinstance(cmd, Prefill):
        return host.loop.submit(eng.add, cmd.work, cmd.target)
    if isinstance(cmd, SetTarget):
        return host.loop.submit(eng.set_target, cmd.request_id, cmd.target)
    if isinstance(cmd, Withdraw):
        return host.loop.submit(eng.withdraw, cmd.request_id)
    return None


PREFILL = Role(make_engine=_engine, execute=_execute, transport=True, listens=False)


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
