"""What the router sends the workers for a request, and what it does with what comes back.

``RequestFlow`` is the part of ``Router`` (``pdserve.router.service``) that carries out a
routing decision and follows the request's tokens: a local prefill is one ``AddLocal`` to the
decode worker; a remote one sends ``Prefill`` and queues the decode worker's reservation at
once (the reservation stays off the TTFT path), then ``SetTarget`` once the blocks are
granted, and ``Start`` on decode when the first token is out. A transfer lost after the first
token is a ``KvLost`` (decode recomputes the prompt: it costs time, not the request). Worker
outputs arrive on ``_on_deltas``; a worker a migrated stream moved away from is fenced off.

Contract: a request that ends is aborted on every worker still holding it (``_release``);
only the current attempt's dispatch fails its stream.

Every method runs on the router's event loop, like the rest of ``Router``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.router.accounting import Accounting
from pdserve.router.config import RouterConfig
from pdserve.router.errors import Code, RouterError
from pdserve.router.policy import Decision, Dispatcher
from pdserve.router.stream import RequestStream
from pdserve.router.workers import WorkerHandle, WorkerLost
from pdserve.worker.commands import (
    Abort,
    AddLocal,
    AwaitReservation,
    KvLost,
    Prefill,
    QueueReservation,
    SetTarget,
    Start,
)
from pdserve.worker.messages import KVTarget, TokenDelta, WorkerRole, WorkItem

log = logging.getLogger("pdserve.router.service")


class RequestFlow:
    # What ``Router`` provides (set in its ``__init__``; its methods, declared for the checker).
    config: RouterConfig
    workers: dict[str, WorkerHandle]
    accounting: Accounting
    dispatcher: Dispatcher
    _streams: dict[str, RequestStream]
    _tasks: set[asyncio.Task[None]]

    if TYPE_CHECKING:

        def _why_not_migrate(self, stream: RequestStream, planned: bool = False) -> str | None: ...

        def _migrate(self, stream: RequestStream, planned: bool = False) -> None: ...

    def _start_dispatch(self, stream: RequestStream, work: WorkItem, decision: Decision) -> None:
        """Send the request where ``decision`` says, beside the reader of its events: the first
        token may arrive before the last dispatch call (the KV target) returns, and must not
        wait for it. Only this attempt's failure fails the stream."""
        stream.work = work
        stream.dispatch = task = asyncio.create_task(self._dispatch(stream, work, decision))
        task.add_done_callback(lambda t: _fail_on_error(stream, t))

    async def _dispatch(self, stream: RequestStream, work: WorkItem, decision: Decision) -> None:
        timeout = self.config.call_timeout_s
        rid = stream.request_id
        if stream.done:
            return
        try:
            decode = self.workers[decision.decode_worker]
            if decision.prefill_worker is None:
                stream.decode_worker = decode.worker_id
                decode.inflight.add(stream.request_id)
                await decode.command(AddLocal(work), timeout)
                stream.taken_in()
            else:
                await self._dispatch_pair(stream, work, self.workers[decision.prefill_worker], decode)
        except WorkerLost as e:
            if stream.request_id != rid or stream.done:
                return  # the stream already moved on (its worker's loss migrated it), or ended
            why_not = self._why_not_migrate(stream)
            if why_not is None:  # a worker lost before it held the request: go elsewhere
                self._migrate(stream)
                return
            raise RouterError(Code.UNAVAILABLE, f"{e}; {why_not}") from None
        except asyncio.TimeoutError:
            raise RouterError(Code.UNAVAILABLE, "a worker did not answer in time") from None
        except (InvalidRequestError, ValueError) as e:
            raise RouterError(Code.INVALID_ARGUMENT, str(e), getattr(e, "field", None)) from None

    async def _dispatch_pair(
        self, stream: RequestStream, work: WorkItem, prefill: WorkerHandle, decode: WorkerHandle
    ) -> None:
        """Prefill starts at once while decode reserves blocks (the reservation stays off the
        TTFT path); the KV target follows, and decode starts once both sides are set."""
        rid = stream.request_id
        stream.decode_worker, stream.prefill_worker = decode.worker_id, prefill.worker_id
        decode.inflight.add(rid)
        prefill.inflight.add(rid)
        wait = self.config.reserve_timeout_s

        async def prefill_taken_in() -> None:
            await prefill.command(Prefill(work), self.config.call_timeout_s)
            stream.taken_in()

        # Prefill goes out first: its call is on the TTFT path, the reservation is not.
        outcomes: tuple[Any, Any] = await asyncio.gather(
            prefill_taken_in(),
            self._reserve(stream, decode, work, wait),
            return_exceptions=True,
        )
        started, target = outcomes
        # The first token may come out before prefill's answer does (two threads there): a
        # prefill worker lost after it is no reason to fail the request (decode recomputes).
        prefill_gone = (
            isinstance(started, (WorkerLost, asyncio.TimeoutError)) and stream.first_token is not None
        )
        for outcome in (started, target):
            if isinstance(outcome, BaseException) and not (outcome is started and prefill_gone):
                raise outcome
        if target is None:
            raise RouterError(
                Code.RESOURCE_EXHAUSTED,
                f"no KV cache room on decode worker {decode.worker_id} within {wait:g}s; retry later",
            )
        if stream.done:
            return
        if prefill_gone:
            self._spawn(self._kv_lost(stream))
            return
        try:
            await prefill.command(SetTarget(rid, target), self.config.call_timeout_s)
        except (WorkerLost, asyncio.TimeoutError):
            if stream.first_token is None:
                raise  # nothing came out yet: the request fails (UNAVAILABLE)
            # The first token is out, so the request goes on: decode recomputes the prompt
            # (told here, or by the worker-loss handler if it saw the loss first), and prefill,
            # should it live, lets go of the prompt's blocks.
            self._spawn(self._kv_lost(stream))
            if rid in prefill.inflight and prefill.alive:
                prefill.inflight.discard(rid)
                self._spawn(self._abort_on(prefill, rid))

    async def _reserve(
        self, stream: RequestStream, decode: WorkerHandle, work: WorkItem, wait: float
    ) -> KVTarget | None:
        """Queue a reservation on ``decode`` (a quick call: once it returned, an abort reaches
        the waiting reservation), then wait for it to be granted."""
        timeout = self.config.call_timeout_s
        # This attempt's own events: a migration gives the stream new ones, which a late end
        # of this attempt must not touch.
        rid, settled, reserved = stream.request_id, stream.reservation_settled, stream.reserved
        try:
            tid = f"kv-{uuid.uuid4().hex}"
            if not await decode.command(QueueReservation(work, tid, wait), timeout):
                return None
            target: KVTarget | None = await decode.command(AwaitReservation(rid), wait + timeout)
            if target is not None and stream.request_id == rid:
                stream.reserved_at = time.perf_counter()
                reserved.set()
            return target
        finally:
            settled.set()

    def _release(self, stream: RequestStream) -> None:
        """Abort the request on every worker still holding it (fire and forget)."""
        for wid in (stream.prefill_worker, stream.decode_worker):
            w = self.workers.get(wid)
            if w is not None and stream.request_id in w.inflight:
                w.inflight.discard(stream.request_id)
                if w.alive:
                    self._spawn(self._abort_on(w, stream.request_id))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort_on(self, w: WorkerHandle, rid: str) -> None:
        try:
            await w.command(Abort(rid), self.config.call_timeout_s)
        except Exception as e:  # a dead worker frees nothing, and needs nothing freed
            log.debug("abort %s on %s: %s", rid, w.worker_id, e)

    # -- worker events -----------------------------------------------------------------------
    def _on_deltas(self, worker: WorkerHandle, deltas: tuple[TokenDelta, ...]) -> None:
        self.dispatcher.on_report(worker.load)
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None or stream.done:
                continue
            if worker.worker_id not in (stream.prefill_worker, stream.decode_worker):
                continue  # a worker the stream moved away from (migration): fenced off
            self.accounting.on_delta(worker.role, stream, d)
            if d.kv_lost:
                # Prefill's push failed after the first token: it holds nothing any more, and
                # decode recomputes the prompt (a lost transfer costs time, not the request).
                worker.inflight.discard(d.request_id)
                self._spawn(self._kv_lost(stream))
                continue
            if d.error is not None:
                stream.fail(RouterError(Code.UNAVAILABLE, f"{worker.worker_id}: {d.error}"))
                continue
            if d.prefilled:
                # Prefill still holds the KV until it is pushed: it stays in prefill's in-flight
                # set (and gets an abort if the request ends) until decode produces tokens.
                decode = self.workers.get(stream.decode_worker)
                if decode is not None and d.token_ids:
                    self._spawn(self._start_decode(decode, stream, d))
                stream.feed(d)
            else:
                if worker.role is WorkerRole.PREFILL:
                    worker.inflight.discard(d.request_id)
                else:
                    prefill = self.workers.get(stream.prefill_worker)
                    if prefill is not None:
                        prefill.inflight.discard(d.request_id)  # the KV arrived: prefill is done
                if stream.feed(d) and d.finished:
                    worker.inflight.discard(d.request_id)

    async def _start_decode(self, decode: WorkerHandle, stream: RequestStream, d: TokenDelta) -> None:
        await asyncio.sleep(0)  # the first token goes to the client before this call goes out
        # Settled however the reservation ends; one that was not granted failed the stream
        # (RESOURCE_EXHAUSTED, from the dispatch).
        await stream.reservation_settled.wait()
        if stream.done or stream.request_id != d.request_id or not stream.reserved.is_set():
            return  # over, or moved on (migration: a new attempt under a new id)
        try:
            await decode.command(
                Start(d.request_id, d.token_ids[0], d.num_cached_tokens), self.config.call_timeout_s
            )
        except Exception as e:
            if stream.request_id == d.request_id:  # else it moved on (migration)
                stream.fail(RouterError(Code.UNAVAILABLE, f"decode worker {decode.worker_id}: {e!r}"))

    async def _kv_lost(self, stream: RequestStream) -> None:
        """Tell the decode worker that the request's KV will not come, so it recomputes the
        prompt now instead of waiting out the transfer's lease."""
        rid, decode = stream.request_id, self.workers.get(stream.decode_worker)
        if decode is None or stream.done:
            return
        await stream.reservation_settled.wait()
        if stream.done or stream.request_id != rid or not stream.reserved.is_set():
            return  # over, or moved on (migration: a new attempt under a new id)
        try:
            await decode.command(KvLost(rid), self.config.call_timeout_s)
        except Exception as e:  # a lost decode worker fails the stream through its own path
            log.debug("kv_lost %s on %s: %s", rid, decode.worker_id, e)


def _fail_on_error(stream: RequestStream, task: asyncio.Task[None]) -> None:
    if task.cancelled() or task is not stream.dispatch:
        return  # cancelled, or an earlier attempt's (a migration replaced it) whatever it raised
    e = task.exception()
    if e is None:
        return
    if not isinstance(e, RouterError):
        log.error("dispatch of %s failed: %r", stream.request_id, e)
        e = RouterError(Code.INTERNAL, f"internal error: {type(e).__name__}")
    stream.fail(e)
