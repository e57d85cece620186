"""The decode and colocated roles of a worker process: the decode engine and its commands."""

from __future__ import annotations

from typing import ClassVar

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.decode_worker.handlers import COLOCATED_HANDLERS, DECODE_HANDLERS
from pdserve.worker.commands import AddLocal, AwaitReservation, KvLost, QueueReservation, Start
from pdserve.worker.host import Role, WorkerHost
from pdserve.worker.messages import KVTarget, WorkerRole, WorkItem


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

    # -- the same commands, in process (tests, tools): one path with the channel's ----------
    def queue_reservation(self, work: WorkItem, transfer_id: str, timeout_s: float) -> bool:
        """Ask for blocks for ``work``'s prompt KV, granted at once or when room frees within
        ``timeout_s`` (first come, first served); returns at once: True if granted or waiting
        (``await_reservation`` gives the outcome), False if refused now. Raises for a request
        this worker cannot serve. An ``abort`` after it returns reaches a waiting reservation."""
        return bool(self.run(QueueReservation(work, transfer_id, timeout_s)))

    def await_reservation(self, request_id: str, timeout_s: float) -> KVTarget | None:
        """The target of a queued reservation once granted; ``None`` if it expired, was
        aborted, or never was (or the worker stopped). Waits on the engine's own queue: it
        costs the loop nothing."""
        target = self.run(AwaitReservation(request_id), timeout_s + 30.0)  # the engine's deadline rules
        return target if isinstance(target, KVTarget) else None

    def reserve(self, work: WorkItem, transfer_id: str, timeout_s: float) -> KVTarget | None:
        """``queue_reservation`` then ``await_reservation``, for callers that may block."""
        if not self.queue_reservation(work, transfer_id, timeout_s):
            return None
        return self.await_reservation(work.request_id, timeout_s)

    def kv_lost(self, request_id: str) -> bool:
        """The request's KV will not come from its prefill worker: recompute it here."""
        return bool(self.run(KvLost(request_id)))

    def start(self, request_id: str, first_token: int, cached_tokens: int) -> bool:
        return bool(self.run(Start(request_id, first_token, cached_tokens)))

    def add_local(self, work: WorkItem) -> None:
        """Prefill and decode ``work`` here (colocated deployments)."""
        self.run(AddLocal(work))
