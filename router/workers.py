"""The router's handles on its workers: calls, output pollers, health.

A ``WorkerHandle`` wraps one worker process behind a ``Caller`` (Ray actor calls in a
cluster, a thread pool around an in-process ``WorkerHost`` in tests and single-process mode).
Outputs arrive over the worker's output channel (``router.outputs``), or, for workers started
without one, through a poller that long-polls ``collect``; either way each batch also brings
the worker's load for the routing policy. A failed call or poll marks the worker UNHEALTHY
(terminal) and the router fails the requests it held.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from model_runtime.worker.host import WorkerInfo
from model_runtime.worker.messages import OutputBatch, TokenDelta, WorkerHealth, WorkerLoad

log = logging.getLogger(__name__)

COLLECT_TIMEOUT_S = 1.0


class Caller(Protocol):
    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any: ...

    def kill(self) -> None: ...


class LocalCaller:
    """Calls methods of an in-process worker host on a thread pool (no Ray)."""

    def __init__(self, host: Any, pool: ThreadPoolExecutor) -> None:
        self.host = host
        self.pool = pool

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.pool, lambda: getattr(self.host, method)(*args))
        return await asyncio.wait_for(fut, timeout_s) if timeout_s else await fut

    def kill(self) -> None:
        self.host.shutdown()


class WorkerLost(Exception):
    """A worker stopped answering: its process died or its loop failed."""


class WorkerHandle:
    def __init__(self, info: WorkerInfo, caller: Caller) -> None:
        self.info = info
        self.caller = caller
        self.worker_id = info.worker_id
        self.role = info.role
        self.health = WorkerHealth.HEALTHY
        blocks = info.kv_blocks
        self.load = WorkerLoad(info.worker_id, info.role, info.address, 0, 0, blocks, blocks, 0)
        self.inflight: set[str] = set()
        self._poller: asyncio.Task[None] | None = None

    @property
    def healthy(self) -> bool:
        return self.health is WorkerHealth.HEALTHY

    def mark_lost(self) -> None:
        self.health = WorkerHealth.UNHEALTHY

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        if self.health is WorkerHealth.UNHEALTHY:
            raise WorkerLost(f"worker {self.worker_id} is unavailable")
        try:
            return await self.caller.call(method, *args, timeout_s=timeout_s)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            raise
        except Exception as e:
            if _is_request_error(e):
                raise
            first_line = str(e).strip().split("\n", 1)[0]
            raise WorkerLost(f"worker {self.worker_id}: {type(e).__name__}: {first_line}") from e

    def start_polling(
        self,
        on_deltas: Callable[[WorkerHandle, tuple[TokenDelta, ...]], None],
        on_lost: Callable[[WorkerHandle, str], Awaitable[None]],
    ) -> None:
        async def poll() -> None:
            while self.health is not WorkerHealth.UNHEALTHY:
                try:
                    batch: OutputBatch = await self.call("collect", COLLECT_TIMEOUT_S)
                except asyncio.CancelledError:
                    return
                except Exception as e:
                    log.error("worker %s lost: %s", self.worker_id, e)
                    self.health = WorkerHealth.UNHEALTHY
                    await on_lost(self, str(e))
                    return
                self.load = batch.load
                if batch.deltas:
                    on_deltas(self, batch.deltas)
                    # Let the streams send what just arrived before the next collect's
                    # submission (Ray serializes calls on this thread) delays them.
                    await asyncio.sleep(0)

        self._poller = asyncio.create_task(poll(), name=f"poll-{self.worker_id}")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)


def _is_request_error(e: BaseException) -> bool:
    """Errors about the request (bad input), not the worker; Ray wraps them in its own type."""
    from model_runtime.errors import InvalidRequestError

    if isinstance(e, (InvalidRequestError, ValueError)):
        return True
    cause = getattr(e, "cause", None)
    return isinstance(cause, (InvalidRequestError, ValueError))
