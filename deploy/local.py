"""All workers in this process (threads, no Ray): tests and quick experiments."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pdserve.deploy.pools import worker_class
from pdserve.router.workers import LocalCaller, WorkerHandle
from pdserve.worker.control import GetInfo
from pdserve.worker.spec import WorkerSpec

_CALLS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="worker-call")


def launch_local(specs: list[WorkerSpec]) -> list[WorkerHandle]:
    """Build each worker host here; returns their handles once all are ready."""
    handles = []
    for ws in specs:
        host = worker_class()(ws)
        handles.append(WorkerHandle(host.control(GetInfo()), LocalCaller(host, _CALLS)))
    return handles
