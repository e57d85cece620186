"""All workers in this process (threads, no Ray): tests and quick experiments."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pdserve.deploy.pools import PoolSpec, host_class
from pdserve.router.workers import LocalCaller, WorkerHandle


def launch_local(spec: PoolSpec, secret: bytes | None = None, router_address: str = "") -> list[WorkerHandle]:
    pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="worker-call")
    handles = []
    for ws in spec.worker_specs(secret, router_address):
        host = host_class(ws.role)(ws)
        handles.append(WorkerHandle(host.info(), LocalCaller(host, pool)))
    return handles
