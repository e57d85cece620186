"""The prefill role's commands: what each does to the ``PrefillEngine`` (the role's table of
``pdserve.worker.handlers``)."""

from __future__ import annotations

from pdserve.worker.commands import Abort, Prefill, SetTarget, Withdraw
from pdserve.worker.handlers import Handlers

PREFILL_HANDLERS: Handlers = {
    Prefill: lambda eng, c: eng.add(c.work, c.target),
    SetTarget: lambda eng, c: eng.set_target(c.request_id, c.target),
    Withdraw: lambda eng, c: eng.withdraw(c.request_id),
    Abort: lambda eng, c: eng.abort(c.request_id),
}
