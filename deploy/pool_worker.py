"""The worker process a deployment starts: any role, and it can switch between them in place
(``WorkerHost.switch_role``), keeping its weights and KV pool."""

from __future__ import annotations

from typing import ClassVar

from pdserve.decode_worker.actor import DecodeWorker
from pdserve.prefill_worker.actor import PrefillWorker


class PoolWorker(PrefillWorker, DecodeWorker):
    ROLES: ClassVar = {**PrefillWorker.ROLES, **DecodeWorker.ROLES}
