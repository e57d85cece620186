"""Keeps each pool at its size: a worker the router lost is replaced by a fresh one.

A replacement is a new worker (a new id, ``<role>-<n>`` counting on from the pool's first
ones; a new process and, on Ray, a new placement group, so it may land on another node) that
joins the running router: the router's output channel expects it, the router checks that it
serves the same model and registers it, and it gets requests once its channel is up. The lost
worker's requests do not wait for it: they have already moved (migration).

Per lost worker::

    LOST -> LAUNCHING -> JOINED
              |  ^
              v  |  (start failed: wait, 1 s doubling to ``MAX_BACKOFF_S``, and try again)
            BACKOFF

``close`` cancels every replacement under way and stops any worker it started that has not
joined yet; joined workers belong to the deployment (``on_joined``) from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable

from pdserve.router.outputs import OutputListener
from pdserve.router.service import Router
from pdserve.router.workers import WorkerHandle
from pdserve.worker.messages import WorkerRole

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0
CONNECT_TIMEOUT_S = 60.0

Launch = Callable[[WorkerRole, str], Awaitable[WorkerHandle]]  # (role, new worker id) -> ready worker


class PoolKeeper:
    def __init__(
        self,
        router: Router,
        outputs: OutputListener,
        launch: Launch,
        first_index: dict[WorkerRole, int],
        on_joined: Callable[[WorkerHandle], None],
    ) -> None:
        self.router = router
        self.outputs = outputs
        self.launch = launch
        self.on_joined = on_joined
        self._ids = {role: itertools.count(n) for role, n in first_index.items()}
        self._tasks: set[asyncio.Task[None]] = set()
        self._starting: set[WorkerHandle] = set()
        self.replaced = 0  # workers that joined in place of a lost one
        self.failed_starts = 0
        router.on_worker_gone = self.lost

    @property
    def pending(self) -> int:
        """Replacements not joined yet."""
        return len(self._tasks)

    def lost(self, worker: WorkerHandle, reason: str) -> None:
        task = asyncio.ensure_future(self._replace(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, old: WorkerHandle) -> None:
        backoff = 1.0
        while True:
            wid = f"{old.role.value}-{next(self._ids[old.role])}"
            try:
                new = await self._start(old.role, wid)
                self.router.add_worker(new, replaces=old.worker_id)
                await self.outputs.wait_connected([wid], CONNECT_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.failed_starts += 1
                log.error("replacing %s with %s failed (%s); retrying in %gs", old.worker_id, wid, e, backoff)
                await self._discard(wid)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
                continue
            self._starting.discard(new)
            self.replaced += 1
            self.on_joined(new)
            log.warning("worker %s replaced %s", wid, old.worker_id)
            return

    async def _start(self, role: WorkerRole, wid: str) -> WorkerHandle:
        self.outputs.expect(wid)
        handle = await self.launch(role, wid)
        self._starting.add(handle)
        return handle

    async def _discard(self, wid: str) -> None:
        """Stop whatever of a failed replacement was started, and forget its id."""
        self.outputs.forget(wid)
        for h in [h for h in self._starting if h.worker_id == wid]:
            self._starting.discard(h)
            h.mark_lost()
            self.router.workers.pop(wid, None)
            with contextlib.suppress(Exception):  # it failed already: stop what is left
                await asyncio.to_thread(h.caller.kill)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for h in list(self._starting):
            await self._discard(h.worker_id)
