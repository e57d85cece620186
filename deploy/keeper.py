"""Starts the workers that join a running deployment: a replacement for each worker the
router lost (``replace_lost``), and those a pool grows by (``grow``).

A replacement is a new worker (a new id, ``<role>-<n>`` counting on from the pool's first
ones; a new process and, on Ray, a new placement group, so it may land on another node) that
joins the running router: the router's output channel expects it, the router checks that it
serves the same model and registers it, and it gets requests once its channel is up. The lost
worker's requests do not wait for it: they have already moved (migration). A worker that
begins to drain after SIGTERM is replaced at once (``leaving``: a surge), while it still
serves; its exit later starts nothing more.

Per lost (or draining) worker::

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
        replace_lost: bool = True,
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
        # Workers draining after SIGTERM whose replacement started when they began to drain.
        self._surged: set[str] = set()
        if replace_lost:
            router.membership.on_worker_gone = self.lost
            router.membership.on_worker_leaving = self.leaving

    @property
    def pending(self) -> int:
        """Replacements not joined yet."""
        return len(self._tasks)

    def lost(self, worker: WorkerHandle, reason: str) -> None:
        if worker.worker_id in self._surged:
            # Replaced since it began to drain: its entry in the router goes with it.
            self._surged.discard(worker.worker_id)
            if self.router.workers.get(worker.worker_id) is worker:
                del self.router.workers[worker.worker_id]
            return
        self._start_replacing(worker)

    def leaving(self, worker: WorkerHandle) -> None:
        """``worker`` began to drain after SIGTERM: its replacement starts now (a surge), not
        once it has left, so the pool is never short of it (the router routes to the draining
        worker while it is the last of its role, until the replacement takes requests)."""
        if worker.worker_id not in self._surged:
            self._surged.add(worker.worker_id)
            log.warning("worker %s is draining: starting its replacement", worker.worker_id)
            self._start_replacing(worker)

    def _start_replacing(self, worker: WorkerHandle) -> None:
        task = asyncio.ensure_future(self._replace(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, old: WorkerHandle) -> None:
        backoff = 1.0
        while True:
            try:
                new = await self._join(old.role, replaces=old.worker_id)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.error("replacing %s failed (%s); retrying in %gs", old.worker_id, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
                continue
            self.replaced += 1
            log.warning("worker %s replaced %s", new.worker_id, old.worker_id)
            return

    async def grow(self, role: WorkerRole) -> WorkerHandle:
        """Start one more worker of pool ``role``; returns it once it takes requests. Raises
        (leaving nothing behind) if it cannot start or join."""
        return await self._join(role)

    async def _join(self, role: WorkerRole, replaces: str = "") -> WorkerHandle:
        wid = f"{role.value}-{next(self._ids[role])}"
        try:
            self.outputs.expect(wid)
            new = await self.launch(role, wid)
            self._starting.add(new)
            self.router.membership.add_worker(new, replaces=replaces)
            await self.outputs.wait_connected([wid], CONNECT_TIMEOUT_S)
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):  # (a close is no failed start)
                self.failed_starts += 1
            await asyncio.shield(self._discard(wid))
            raise
        self._starting.discard(new)
        self.on_joined(new)
        return new

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
