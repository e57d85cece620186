"""The router's driver of each request's state machine (``pdserve.router.lifecycle``).

``RequestFlow`` carries out what an ``Attempt`` decides, on the router's event loop: each
``Send`` goes to its worker's command channel (in the order emitted, so one worker's commands
arrive in order), and its answer or failure goes back to the attempt that sent it; worker
outputs arrive on ``on_deltas``; which workers hold a request is kept on their handles
(``WorkerHandle.inflight``, which worker losses and drains read). The decisions — what to send
when, what a lost transfer or worker means for the request — are the attempt's, the same the
simulator drives.

Contract: a request that ends is aborted on every worker still holding it (``release``); only
the current attempt's outcome reaches its stream (a replaced attempt emits nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.router.accounting import Accounting
from pdserve.router.config import RouterConfig
from pdserve.router.errors import RouterError
from pdserve.router.lifecycle import (
    Attempt,
    Deliver,
    Drop,
    Effect,
    Fail,
    Failure,
    Hold,
    Relocate,
    Reserved,
    Send,
    TakenIn,
    Timeouts,
    failure_of,
)
from pdserve.router.policy import Decision
from pdserve.router.stream import RequestStream
from pdserve.router.workers import WorkerHandle, WorkerLost
from pdserve.worker.commands import Abort, Command
from pdserve.worker.messages import KvEvents, TokenDelta, WorkItem

log = logging.getLogger("pdserve.router.service")

# (the stream, why, planned) -> None: move it to other workers, or fail it with ``why`` and the
# reason it cannot move (``planned``: its worker leaves by a planned change, not a fault)
Relocator = Callable[[RequestStream, str, bool], None]


class RequestFlow:
    def __init__(
        self,
        config: RouterConfig,
        workers: dict[str, WorkerHandle],
        accounting: Accounting,
        streams: dict[str, RequestStream],
        relocate: Relocator,
    ) -> None:
        self.workers = workers
        self.accounting = accounting
        self.streams = streams  # by the router's own request id (the router's map)
        self.relocate = relocate
        self.timeouts = Timeouts(config.call_timeout_s, config.reserve_timeout_s)
        self.tasks: set[asyncio.Task[None]] = set()
        # Every command sent, with its worker (tests compare it with the simulator's).
        self.on_send: Callable[[Send], None] | None = None

    def start(self, stream: RequestStream, work: WorkItem, decision: Decision) -> None:
        """Send the request where ``decision`` says: a new attempt under ``work``'s id."""
        prefill = self.workers.get(decision.prefill_worker or "")
        source_ranks = prefill.info.kv_ranks if prefill is not None else 1
        attempt = Attempt(work, decision.decode_worker, decision.prefill_worker, self.timeouts, source_ranks)
        stream.work, stream.attempt = work, attempt
        stream.decode_worker, stream.prefill_worker = attempt.decode, attempt.prefill or ""
        self.apply(stream, attempt, attempt.dispatch())

    def release(self, stream: RequestStream) -> None:
        """The request ended, or moves on under a new id: its attempt lets go of it everywhere.
        The answers its commands still wait for no longer matter (the workers' channels drop
        them when they come)."""
        for task in list(stream.calls):
            task.cancel()
        if stream.attempt is not None:
            self.apply(stream, stream.attempt, stream.attempt.end())

    def worker_lost(self, stream: RequestStream, worker: WorkerHandle, why: str, planned: bool) -> None:
        """``worker``, which holds ``stream``'s attempt, is lost or leaves its pool (``why``;
        ``planned``: by a planned change)."""
        attempt = stream.attempt
        if attempt is not None and attempt.request_id == stream.request_id:
            self.apply(stream, attempt, attempt.worker_lost(worker.worker_id), why, planned)

    def forget(self, stream: RequestStream, worker: WorkerHandle) -> None:
        """``worker`` let go of ``stream``'s attempt by itself (it gave the prompt back)."""
        attempt = stream.attempt
        if attempt is not None and attempt.request_id == stream.request_id:
            self.apply(stream, attempt, attempt.forget(worker.worker_id))

    def on_kv_events(self, worker: WorkerHandle, events: KvEvents) -> None:
        """What ``worker``'s prefix cache stored and evicted: where prompts' prefixes are."""
        self.accounting.dispatcher.on_kv_events(worker.worker_id, events)

    def on_deltas(self, worker: WorkerHandle, deltas: tuple[TokenDelta, ...]) -> None:
        self.accounting.dispatcher.on_report(worker.load)
        for d in deltas:
            stream = self.streams.get(d.request_id)
            if stream is None or stream.done or stream.attempt is None:
                continue
            attempt = stream.attempt
            if attempt.steady(worker.worker_id, d):
                self._deliver(stream, worker, d)
            else:
                self.apply(stream, attempt, attempt.on_delta(worker.worker_id, d))

    # -- carrying out what the attempt decided ----------------------------------------------------
    def apply(
        self,
        stream: RequestStream,
        attempt: Attempt,
        effects: list[Effect],
        why: str = "",
        planned: bool = False,
    ) -> None:
        """Carry out ``effects``; a ``Relocate`` says ``why`` (the attempt's own reason if
        empty)."""
        rid = attempt.request_id
        for e in effects:
            if isinstance(e, Send):
                self._send(stream, attempt, e)
            elif isinstance(e, Hold):
                self.workers[e.worker].inflight.add(rid)
            elif isinstance(e, Drop):
                w = self.workers.get(e.worker)
                if w is not None:
                    w.inflight.discard(rid)
            elif isinstance(e, Deliver):
                self._deliver(stream, self.workers.get(e.worker), e.delta)
            elif isinstance(e, Fail):
                stream.fail(RouterError(e.code, e.message, e.field))
            elif isinstance(e, Relocate):
                if stream.request_id == rid and not stream.done:
                    self.relocate(stream, why or e.why, planned)
            elif isinstance(e, TakenIn):
                stream.taken_in()
            elif isinstance(e, Reserved):
                stream.reserved_at = time.perf_counter()

    def _deliver(self, stream: RequestStream, w: WorkerHandle | None, d: TokenDelta) -> None:
        if w is not None:
            self.accounting.on_delta(w.role, stream, d)
        stream.feed(d)

    def _send(self, stream: RequestStream, attempt: Attempt, sent: Send) -> None:
        w = self.workers.get(sent.worker)
        if w is None or not w.alive:
            # A gone worker frees nothing and needs nothing freed; a command that mattered
            # fails as the worker's loss.
            if not sent.quiet:
                why = f"worker {sent.worker} is unavailable"
                self.apply(stream, attempt, attempt.call_failed(sent, Failure.LOST, why))
            return
        if self.on_send is not None:
            self.on_send(sent)
        try:
            # Out now, in the order emitted: the answer is awaited beside the stream's reader.
            answer = w.send(sent.command)
        except WorkerLost as e:
            if not sent.quiet:
                self.apply(stream, attempt, attempt.call_failed(sent, Failure.LOST, str(e)))
            return
        task = self.spawn(self._call(stream, attempt, w, sent, answer))
        stream.calls.add(task)
        task.add_done_callback(stream.calls.discard)

    def abort_on(self, w: WorkerHandle, request_id: str) -> None:
        """Abort a request no attempt speaks for any more (its stream ended) on ``w``."""
        if w.alive:
            self.spawn(self._quiet(w, Abort(request_id)))

    async def _quiet(self, w: WorkerHandle, cmd: Command) -> None:
        try:
            await w.command(cmd, self.timeouts.call_s)
        except Exception as e:  # a dead worker frees nothing, and needs nothing freed
            log.debug("%s on %s: %s", cmd, w.worker_id, e)

    async def _call(
        self,
        stream: RequestStream,
        attempt: Attempt,
        w: WorkerHandle,
        sent: Send,
        answer: asyncio.Future[Any],
    ) -> None:
        try:
            value = await asyncio.wait_for(answer, sent.timeout_s)
        except WorkerLost as e:
            effects = attempt.call_failed(sent, Failure.LOST, str(e))
        except Exception as e:
            failure, message, field = failure_of(e)
            if failure is Failure.INTERNAL and not sent.quiet:
                log.error("%s of %s on %s failed: %r", type(sent.command).__name__, attempt.request_id,
                          w.worker_id, e)  # fmt: skip
            effects = attempt.call_failed(sent, failure, message, field)
        else:
            effects = attempt.answered(sent, value)
        self.apply(stream, attempt, effects)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task
