"""What a deployment consists of, independent of where it runs (pure data)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from pdserve.kvtransfer.transport import TransportConfig
from pdserve.model_runtime.engine.runtime import EngineConfig
from pdserve.worker.host import WorkerSpec
from pdserve.worker.messages import WorkerRole


@dataclass(frozen=True)
class PoolSpec:
    """``prefill`` + ``decode`` workers, or ``colocated`` engines (then prefill/decode are unused)."""

    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    cpus_per_worker: int = 1
    gpus_per_worker: int = 0  # 0: CPU workers

    def __post_init__(self) -> None:
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("worker counts must be >= 0")
        if self.colocated == 0 and (self.prefill < 1 or self.decode < 1):
            raise ValueError("a disaggregated deployment needs at least one prefill and one decode worker")
        if self.cpus_per_worker < 1:
            raise ValueError("cpus_per_worker must be >= 1")

    @property
    def is_colocated(self) -> bool:
        return self.colocated > 0

    @property
    def num_workers(self) -> int:
        return self.colocated if self.is_colocated else self.prefill + self.decode

    def worker_specs(self, secret: bytes | None = None, router_address: str = "") -> list[WorkerSpec]:
        """One spec per worker, all sharing ``secret`` (fresh if not given)."""
        secret = secret or secrets.token_bytes(32)
        roles: list[tuple[WorkerRole, int]] = (
            [(WorkerRole.COLOCATED, self.colocated)]
            if self.is_colocated
            else [(WorkerRole.PREFILL, self.prefill), (WorkerRole.DECODE, self.decode)]
        )
        return [
            WorkerSpec(
                worker_id=f"{role.value}-{i}",
                role=role,
                engine=self.engine,
                transport=self.transport,
                secret=secret,
                num_threads=self.cpus_per_worker,
                router_address=router_address,
            )
            for role, n in roles
            for i in range(n)
        ]


def host_class(role: WorkerRole) -> type:
    from pdserve.decode_worker.actor import DecodeWorker
    from pdserve.prefill_worker.actor import PrefillWorker

    return PrefillWorker if role is WorkerRole.PREFILL else DecodeWorker
