"""The decode and colocated roles of a worker process: the decode engine and its commands'
tables (a test or tool sends them with ``WorkerHost.run``, as the router does over the worker
channel)."""

from __future__ import annotations

from typing import ClassVar

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.handlers import COLOCATED_HANDLERS, DECODE_HANDLERS
from pdserve.worker.host import Role, WorkerHost
from pdserve.worker.messages import WorkerRole


def _decode_engine(host: WorkerHost) -> DecodeEngine:
    return DecodeEngine(
        host.rt,
        host.transport,
        host.spec.engine.scheduler,
        host.spec.worker_id,
        WorkerRole.DECODE,
        overlap=host.rt.overlap,
    )


def _colocated_engine(host: WorkerHost) -> DecodeEngine:
    # No transport: a colocated engine neither sends nor receives KV.
    return DecodeEngine(
        host.rt,
        None,
        host.spec.engine.scheduler,
        host.spec.worker_id,
        WorkerRole.COLOCATED,
        overlap=host.rt.overlap,
    )


DECODE = Role(make_engine=_decode_engine, handlers=DECODE_HANDLERS, transport=True, listens=True)
COLOCATED = Role(make_engine=_colocated_engine, handlers=COLOCATED_HANDLERS, transport=False, listens=False)


class DecodeWorker(WorkerHost):
    ROLES: ClassVar = {WorkerRole.DECODE: DECODE, WorkerRole.COLOCATED: COLOCATED}
