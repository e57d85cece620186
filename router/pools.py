"""Which of the router's workers serve which role, and which take requests now (no I/O).

``Pools`` is shared by the parts of the router that read it: admission and routing
(``Router``), and workers coming and going (``Membership``), which also changes it.
"""

from __future__ import annotations

from pdserve.router.workers import WorkerHandle
from pdserve.worker.messages import WorkerRole


class Pools:
    def __init__(self, workers: dict[str, WorkerHandle], colocated: bool) -> None:
        self.workers = workers  # every worker the router knows, lost ones until replaced
        self.colocated = colocated

    @property
    def roles(self) -> tuple[WorkerRole, ...]:
        """The roles of this deployment's pools."""
        return (WorkerRole.COLOCATED,) if self.colocated else (WorkerRole.PREFILL, WorkerRole.DECODE)

    @property
    def decode_role(self) -> WorkerRole:
        """The role of the workers that decode (and may prefill) requests."""
        return WorkerRole.COLOCATED if self.colocated else WorkerRole.DECODE

    def routable(self, role: WorkerRole) -> list[WorkerHandle]:
        """The workers of ``role`` that take new requests."""
        return [w for w in self.workers.values() if w.role is role and w.routable]

    def decoders(self) -> list[WorkerHandle]:
        """The workers new requests are decoded on: those that take requests or, while none
        does, those draining after SIGTERM that have not been released (they serve until their
        replacement is up)."""
        role = self.decode_role
        return self.routable(role) or [w for w in self.workers.values() if w.role is role and w.held]
