"""How a worker's KV transport is set up (pure data): which backend, where it listens, and
every timeout and lease (``pdserve.kvtransfer.transport`` uses it)."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "tcp", "shm", "cuda_ipc", "nccl")
# A ``host`` that the worker (and the router, for its channels) replace with the address of the
# node it runs on as Ray sees it: what a multi-node deployment needs, with no address by hand.
NODE_ADDRESS = "node"


@dataclass(frozen=True)
class TransportConfig:
    backend: str = "auto"
    host: str = "127.0.0.1"  # never 0.0.0.0 unless asked
    port: int = 0
    io_timeout_s: float = 5.0  # any single socket operation
    connect_timeout_s: float = 3.0  # sender: connecting (retried while refused or reset) and its set-up
    handshake_timeout_s: float = 2.0  # receiver: an unauthenticated connection's whole set-up
    lease_s: float = 30.0  # receiver: how long reserved blocks wait for their transfer
    send_timeout_s: float = 30.0  # sender: whole-transfer deadline
    fence_grace_s: float = 2.0  # direct-write receiver: lease end + this bounds an unconfirmed writer

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown KV transfer backend {self.backend!r}; choose from {', '.join(BACKENDS)}"
            )
