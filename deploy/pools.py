"""What a deployment consists of, independent of where it runs (pure data)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace

from pdserve.kvtransfer.config import TransportConfig
from pdserve.kvtransfer.tls import InternalTls
from pdserve.model_runtime.config import EngineConfig
from pdserve.steptime.roofline import TP_DEGREES
from pdserve.worker.messages import WorkerRole
from pdserve.worker.spec import WorkerSpec


@dataclass(frozen=True)
class PoolSpec:
    """``prefill`` + ``decode`` workers, or ``colocated`` engines (then prefill/decode are unused)."""

    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    cpus_per_worker: int = 1  # per rank: a TP worker of degree t takes t times as many
    gpus_per_worker: int = 0  # 0: CPU workers; per rank, like cpus_per_worker
    # Tensor-parallel degree: the GPUs (ranks) each prefill / decode worker spans; colocated
    # engines take decode_tp (``--prefill-tp`` / ``--decode-tp``).
    prefill_tp: int = 1
    decode_tp: int = 1
    replace_lost: bool = True  # a worker the router lost is replaced by a fresh one
    drain_timeout_s: float = 30.0  # a worker told to stop (SIGTERM) lets its requests finish this long
    internal_tls: bool = False  # the KV and worker channels over TLS (a CA per deployment)
    # The most workers it may run at once (an autoscaled deployment's maximum); a private Ray
    # instance is sized for it, or a pool could never grow past its first size. 0: num_workers.
    max_workers: int = 0

    def __post_init__(self) -> None:
        for name, tp in (("prefill_tp", self.prefill_tp), ("decode_tp", self.decode_tp)):
            if tp not in TP_DEGREES:
                raise ValueError(f"{name} must be one of {', '.join(map(str, TP_DEGREES))}, not {tp}")
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("worker counts must be >= 0")
        if self.colocated == 0 and (self.prefill < 1 or self.decode < 1):
            raise ValueError("a disaggregated deployment needs at least one prefill and one decode worker")
        if self.max_workers < 0:
            raise ValueError(f"max_workers must be >= 0, not {self.max_workers}")
        if self.cpus_per_worker < 1:
            raise ValueError("cpus_per_worker must be >= 1")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, not {self.drain_timeout_s}")

    @property
    def is_colocated(self) -> bool:
        return self.colocated > 0

    @property
    def num_workers(self) -> int:
        return self.colocated if self.is_colocated else self.prefill + self.decode

    @property
    def capacity(self) -> int:
        """Ranks a private Ray instance must have room for (a TP worker counts its ranks)."""
        widest = max(self.tp_of(role) for role, _ in self.roles)
        return max(self.num_workers, self.max_workers) * widest

    def tp_of(self, role: WorkerRole) -> int:
        """The tensor-parallel degree of pool ``role``'s workers."""
        return self.prefill_tp if role is WorkerRole.PREFILL else self.decode_tp

    @property
    def roles(self) -> tuple[tuple[WorkerRole, int], ...]:
        """Each pool's role and size."""
        if self.is_colocated:
            return ((WorkerRole.COLOCATED, self.colocated),)
        return ((WorkerRole.PREFILL, self.prefill), (WorkerRole.DECODE, self.decode))

    def worker_spec(
        self,
        role: WorkerRole,
        worker_id: str,
        secret: bytes,
        router_address: str = "",
        own_process: bool = False,
        tls: InternalTls | None = None,
        replicas: tuple[str, ...] = (),
    ) -> WorkerSpec:
        """One worker of pool ``role``; ``own_process``: it drains and exits on SIGTERM; ``tls``:
        the deployment's internal TLS material (required when ``internal_tls`` is set);
        ``replicas``: the router replicas' worker channels (``pdserve serve --routers N``)."""
        if self.internal_tls and tls is None:
            raise ValueError("internal_tls is set: give the workers the deployment's TLS material")
        return WorkerSpec(
            worker_id=worker_id,
            role=role,
            engine=replace(self.engine, tp=self.tp_of(role)),
            transport=self.transport,
            secret=secret,
            internal_tls=tls if self.internal_tls else None,
            num_threads=self.cpus_per_worker,
            router_address=router_address,
            replica_addresses=replicas,
            drain_timeout_s=self.drain_timeout_s,
            drain_on_sigterm=own_process,
        )

    def worker_specs(
        self,
        secret: bytes | None = None,
        router_address: str = "",
        own_process: bool = False,
        tls: InternalTls | None = None,
        replicas: tuple[str, ...] = (),
    ) -> list[WorkerSpec]:
        """One spec per worker (ids ``<role>-<i>``), all sharing ``secret`` (fresh if not given)
        and ``tls`` (fresh if ``internal_tls`` and not given)."""
        secret = secret or secrets.token_bytes(32)
        if self.internal_tls and tls is None:
            tls = InternalTls.generate()
        return [
            self.worker_spec(role, f"{role.value}-{i}", secret, router_address, own_process, tls, replicas)
            for role, n in self.roles
            for i in range(n)
        ]


def worker_class() -> type:
    """The class every worker of a deployment runs (imported here only when needed: it loads torch)."""
    from pdserve.deploy.pool_worker import PoolWorker

    return PoolWorker
