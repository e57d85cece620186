"""The worker process a deployment starts: any role, and it can switch between them in place
(``WorkerHost.switch_role``), keeping its weights and KV pool."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from pdserve.decode_worker.actor import DecodeWorker
from pdserve.kvtransfer.config import NODE_ADDRESS
from pdserve.prefill_worker.actor import PrefillWorker
from pdserve.worker.spec import WorkerSpec


def node_address() -> str:
    """This process's node as Ray sees it (its cluster address), or loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return "127.0.0.1"


def on_this_node(spec: WorkerSpec) -> WorkerSpec:
    """``spec`` with a KV transport that listens on this node's address when it says
    ``NODE_ADDRESS``, so a peer on another node can reach it."""
    if spec.transport.host != NODE_ADDRESS:
        return spec
    return replace(spec, transport=replace(spec.transport, host=node_address()))


class PoolWorker(PrefillWorker, DecodeWorker):
    ROLES: ClassVar = {**PrefillWorker.ROLES, **DecodeWorker.ROLES}

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(on_this_node(spec))
