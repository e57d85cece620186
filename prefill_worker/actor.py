"""The prefill role of a worker process: the prefill engine and its commands' table (a test or
tool sends them with ``WorkerHost.run``, as the router does over the worker channel)."""

from __future__ import annotations

from typing import ClassVar

from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.prefill_worker.handlers import PREFILL_HANDLERS
from pdserve.worker.host import Role, WorkerHost
from pdserve.worker.messages import WorkerRole


def _engine(host: WorkerHost) -> PrefillEngine:
    assert host.transport is not None
    return PrefillEngine(host.rt, host.transport, host.spec.engine.scheduler, host.spec.worker_id)


PREFILL = Role(make_engine=_engine, handlers=PREFILL_HANDLERS, transport=True, listens=False)


class PrefillWorker(WorkerHost):
    ROLES: ClassVar = {WorkerRole.PREFILL: PREFILL}
