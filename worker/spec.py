"""What one worker process is told to be (pure data): its id and role, engine and transport
settings, the cluster secret, and where its router listens. ``pdserve.worker.host`` builds the
process from it; deployments (``pdserve.deploy``) write it without loading the model stack."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kvtransfer.config import TransportConfig
from pdserve.kvtransfer.tls import InternalTls
from pdserve.model_runtime.config import EngineConfig
from pdserve.worker.messages import WorkerRole


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: WorkerRole
    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    secret: bytes = b""  # cluster secret (>= 16 bytes): KV transport and output channel
    internal_tls: InternalTls | None = None  # set: the KV and worker channels run over TLS
    num_threads: int = 0  # torch intra-op threads: its placement's CPUs; 0: its process's allotment
    router_address: str = ""  # "host:port" of the router's output channel; "" = callers poll collect
    # Router replicas' channels ("host:port" each; ``pdserve serve --routers N``): the worker
    # connects to each too, and again whenever one ends, for as long as it runs.
    replica_addresses: tuple[str, ...] = ()
    drain_timeout_s: float = 30.0  # on SIGTERM: how long held requests get to finish
    drain_on_sigterm: bool = False  # install the SIGTERM drain (own worker processes only)

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0:  # NaN too
            raise ValueError(f"drain_timeout_s must be >= 0, not {self.drain_timeout_s}")
