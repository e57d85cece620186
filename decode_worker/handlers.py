"""The decode and colocated roles' commands: what each does to the ``DecodeEngine`` (the roles'
tables of ``pdserve.worker.handlers``). A colocated engine takes only whole requests: the rest
is the KV hand-off, which it does not do."""

from __future__ import annotations

from concurrent.futures import Future

from pdserve.worker.commands import (
    Abort,
    AddLocal,
    AwaitReservation,
    KvLost,
    QueueReservation,
    Start,
)
from pdserve.worker.handlers import Handlers
from pdserve.worker.messages import KVTarget


def _queued(outcome: Future[KVTarget | None]) -> bool:
    """A reservation is granted or waiting (not refused at once)."""
    return not outcome.done() or outcome.result() is not None


COLOCATED_HANDLERS: Handlers = {
    AddLocal: lambda eng, c: eng.add_local(c.work),
    Abort: lambda eng, c: eng.abort(c.request_id),
}

DECODE_HANDLERS: Handlers = {
    **COLOCATED_HANDLERS,
    QueueReservation: lambda eng, c: _queued(eng.reserve(c.work, c.transfer_id, c.timeout_s, c.source_ranks)),
    AwaitReservation: lambda eng, c: eng.reservation(c.request_id),
    Start: lambda eng, c: eng.start(c.request_id, c.first_token, c.cached_tokens),
    KvLost: lambda eng, c: eng.kv_lost(c.request_id),
}
