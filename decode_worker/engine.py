"""The decode role: continuous batching over requests whose KV a prefill worker pushed here.

It is a colocated engine (``ColocatedScheduler``) that can also admit requests whose prompt KV
arrives over the transport, so the same class serves three paths: remote prefill (the
disaggregated path), local prefill (``--colocated`` deployments and short prompts), and
recompute of requests preempted when the pool runs dry.

A remotely prefilled request on this worker::

    reserve() -> PENDING (no room yet: waits, first come first served, until its deadline)
      PENDING --room--> RESERVED;  PENDING --deadline | abort--> gone (the caller gets None)
    reserve() -> RESERVED (blocks allocated, transport expects the transfer)
      RESERVED --transfer DONE + start(first token)--> DECODING (in the continuous batch)
      RESERVED --transfer FAILED | kv_lost()--> blocks freed; on start(first token): recomputed
                                    locally (prompt + first token prefilled here), then DECODING
      RESERVED --abort--> transfer cancelled; blocks freed once the transport reports it failed
                          (a direct-write sender may still be writing until then)
    DECODING --finished | abort--> blocks freed (retired until a step in flight that writes
                                    them is read, with overlap)

A pending reservation is a future the engine resolves on its own thread (between steps, when
room frees or its deadline passes), so a caller waiting for room holds no engine time and other
commands never queue behind it.

Ids: the router's commands arrive in the order it sent them (one channel per worker), so an
abort never overtakes the add it cancels, and an unknown id leaves no trace.

Overlap (``overlap=True``, a GPU's default): a step is launched and its tokens read at the next
``step``, after the step that follows it was planned (``ColocatedScheduler.schedule_ahead``) and
launched, so the device runs one step while the host turns the last one into deltas and plans
the next. Stops are thus seen one step late: a request that ends on a stop token had one more
row computed, whose token is dropped (a ``max_tokens`` end is known ahead and costs nothing). A
step whose plan would preempt, or that has a prompt to prefill, is planned after the running
step's update instead, and a step with prompt chunks is read before the engine returns (an
abort frees a prompt's blocks at once, which a step in flight could still be writing).

Single-threaded: one caller serializes every method.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from pdserve.kvtransfer.states import FailureCause
from pdserve.model_runtime.engine.runner import StepHandle
from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.kv_cache.manager import blocks_needed
from pdserve.model_runtime.request import FinishReason, Request
from pdserve.model_runtime.sampling.logprob import Logprob
from pdserve.model_runtime.scheduler.colocated import ColocatedScheduler
from pdserve.model_runtime.scheduler.plan import SchedulePlan, SchedulerConfig
from pdserve.model_runtime.validation import validate_request
from pdserve.worker.deltas import delta_for, error_delta
from pdserve.worker.engine_base import RoleEngineBase
from pdserve.worker.grammar_gate import GrammarGate
from pdserve.worker.loop import WorkerFailed
from pdserve.worker.messages import KVTarget, TokenDelta, WorkerRole, WorkItem
from pdserve.worker.ports import Clock, RoleRuntime, Transport

log = logging.getLogger(__name__)


@dataclass
class Reservation:
    transfer_id: str
    target: KVTarget
    received: bool = False
    failed: bool = False
    first: tuple[int, int] | None = None  # the first token, prompt tokens prefill found cached


@dataclass
class LaunchedStep:
    plan: SchedulePlan
    handle: StepHandle
    owners: dict[str, Request]  # the request each chunk was planned for (ids may be re-used)


@dataclass
class PendingReservation:
    request: Request
    transfer_id: str
    deadline: float  # on the engine's clock
    future: Future[KVTarget | None]
    source_ranks: int = 1


class DecodeEngine(RoleEngineBase):
    def __init__(
        self,
        rt: RoleRuntime,
        transport: Transport | None,
        config: SchedulerConfig,
        worker_id: str,
        role: WorkerRole = WorkerRole.DECODE,
        clock: Clock = time.monotonic,
        overlap: bool = False,
    ) -> None:
        self.rt = rt
        self.overlap = overlap
        self._launched: LaunchedStep | None = None  # overlap: the step whose tokens are read next
        self.clock = clock
        self.transport = transport
        self.worker_id = worker_id
        self.role = role
        self.kv = rt.kv
        self.scheduler = ColocatedScheduler(rt.kv, config)
        self.limits = rt.limits()
        self._requests: dict[str, Request] = {}
        self._emitted: dict[str, int] = {}
        self._reserved: dict[str, Reservation] = {}
        self._by_transfer: dict[str, str] = {}
        self._cancelling: dict[str, str] = {}  # transfer id -> request id, blocks still held
        self._pending: OrderedDict[str, PendingReservation] = OrderedDict()  # waiting for room
        self.gate = GrammarGate(rt.grammars)  # requests waiting for their constraint's grammar
        self._errors: list[TokenDelta] = []  # requests this worker gave up on, to report
        self.transfers_failed = 0
        self.recomputed = 0

    # -- commands ----------------------------------------------------------------------------
    def _new_request(self, work: WorkItem) -> Request:
        rid = work.request_id
        if rid in self._requests or rid in self._pending or self.kv.holds(rid):
            # (kv.holds: an aborted reservation's blocks wait under its id for the transport)
            raise ValueError(f"request {rid!r} is already on this worker")
        validate_request(work.prompt_token_ids, work.params, self.limits)
        self.gate.prepare(work.params.constraint)  # its compile runs while the KV arrives
        return Request(work.request_id, work.prompt_token_ids, work.params, self.rt.eos_ids, work.priority)

    def add_local(self, work: WorkItem) -> None:
        """Prefill and decode here (colocated path; also a request moved here from a lost
        worker: its ``output_token_ids`` are recomputed with the prompt, and only the tokens
        after them are reported)."""
        req = self._new_request(work)
        if len(work.output_token_ids) >= work.params.max_tokens:
            raise ValueError(f"request {work.request_id!r} has no tokens left to generate")
        if any(not 0 <= t < self.limits.vocab_size for t in work.output_token_ids):
            raise InvalidRequestError("output_token_ids", "a token id is outside the vocabulary")
        for t in work.output_token_ids:
            req.append_token(t)
        self.gate.hold(req, lambda: self.scheduler.add_request(req))  # raises if refused
        self._requests[req.request_id] = req
        self._emitted[req.request_id] = len(work.output_token_ids)

    def held(self, request_id: str) -> Request | None:
        """The request held under ``request_id``, whose progress an in-process driver reads
        (``pdserve.decode_worker.offline``); None once it ended."""
        return self._requests.get(request_id)

    def reserve(
        self, work: WorkItem, transfer_id: str, timeout_s: float = 0.0, source_ranks: int = 1
    ) -> Future[KVTarget | None]:
        """Reserve blocks for the prompt's KV, waiting up to ``timeout_s`` for room; the future
        resolves to the target, or ``None`` if no room freed in time (or the request was
        aborted meanwhile). Raises at once for a request this worker cannot serve.
        ``source_ranks``: the KV ranks of the prefill worker that will push it."""
        if self.transport is None:
            raise RuntimeError("this worker has no KV transport (colocated)")
        fut: Future[KVTarget | None] = Future()
        req = self._new_request(work)  # validates, and refuses an id already here
        target = None if self._pending else self._try_reserve(req, transfer_id, source_ranks)
        if target is not None or timeout_s <= 0:
            fut.set_result(target)
        else:
            deadline = self.clock() + timeout_s
            self._pending[work.request_id] = PendingReservation(req, transfer_id, deadline, fut, source_ranks)
        return fut

    def _try_reserve(self, req: Request, transfer_id: str, source_ranks: int) -> KVTarget | None:
        """Keeps one free block per running request so they can keep growing."""
        assert self.transport is not None
        n = req.num_prompt_tokens
        headroom = self.kv.num_free_blocks - blocks_needed(n, self.rt.block_size)
        if headroom < self.scheduler.num_running or not self.kv.allocate_slots(req, n):
            return None
        blocks = self.kv.block_table_view(req.request_id)
        try:
            self.transport.expect(transfer_id, blocks, source_ranks)
        except BaseException:
            self.kv.free(req.request_id)
            raise
        t = self.transport
        target = KVTarget(transfer_id, t.address, tuple(t.offers), blocks, t.rank_addresses)
        self._requests[req.request_id] = req
        self._reserved[req.request_id] = Reservation(transfer_id, target)
        self._by_transfer[transfer_id] = req.request_id
        return target

    def _serve_pending(self) -> None:
        """Grant waiting reservations in arrival order while room lasts; expire late ones."""
        now = self.clock()
        blocked = False
        for rid, p in list(self._pending.items()):
            target = None
            if not blocked:
                try:
                    target = self._try_reserve(p.request, p.transfer_id, p.source_ranks)
                except Exception as e:  # this reservation's fault (say, a transfer id in use)
                    del self._pending[rid]
                    p.future.set_exception(e)
                    continue
                blocked = target is None
            if target is not None or now >= p.deadline:
                del self._pending[rid]
                p.future.set_result(target)

    def reservation(self, request_id: str) -> Future[KVTarget | None]:
        """The outcome of ``reserve`` for ``request_id``: still waiting (an unresolved future),
        granted (its target), or none (refused, expired, aborted or already started)."""
        pending = self._pending.get(request_id)
        if pending is not None:
            return pending.future
        fut: Future[KVTarget | None] = Future()
        res = self._reserved.get(request_id)
        fut.set_result(res.target if res is not None and not res.failed else None)
        return fut

    def on_stop(self) -> None:
        """The loop stopped: nothing will be granted any more. The waiting reservations fail as
        the worker's fault (the router moves their requests), not as "no room" (which would
        send the client a RESOURCE_EXHAUSTED it did not cause)."""
        for p in self._pending.values():
            p.future.set_exception(WorkerFailed("worker loop stopped"))
        self._pending.clear()

    def kv_lost(self, request_id: str) -> bool:
        """The prefill worker will not deliver this request's KV (its push failed, or it died):
        stop waiting for it and recompute once the first token is known."""
        res = self._reserved.get(request_id)
        if res is None or res.received or res.failed or self.transport is None:
            return False
        self.transport.cancel(res.transfer_id)  # reported FAILED(cancelled) by the next poll
        return True

    def start(self, request_id: str, first_token: int, cached: int) -> bool:
        """The prefill worker sampled ``first_token``; decode starts once the KV is in."""
        res = self._reserved.get(request_id)
        if res is None:
            return False
        res.first = (first_token, cached)
        self._maybe_begin(request_id, res)
        return True

    def abort(self, request_id: str) -> bool:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.future.set_result(None)
            return True
        if self.gate.drop(request_id):
            self._drop_held(request_id)
            return True
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._emitted.pop(request_id, None)
        res = self._reserved.pop(request_id, None)
        if res is not None:
            self._by_transfer.pop(res.transfer_id, None)
            if res.received:
                self.kv.free(request_id)
            elif not res.failed and self.transport is not None:
                self._cancelling[res.transfer_id] = request_id
                self.transport.cancel(res.transfer_id)
        else:
            self.scheduler.finish(request_id, FinishReason.ABORT)
        self.rt.runner.release(request_id)
        return True

    def _drop_held(self, request_id: str) -> None:
        """A request that never joined the batch leaves (its grammar was not ready)."""
        self._requests.pop(request_id, None)
        self._emitted.pop(request_id, None)
        if self.kv.holds(request_id):  # its prompt's KV arrived
            self.kv.free(request_id)
        self.rt.runner.release(request_id)

    # -- transfers ---------------------------------------------------------------------------
    def _poll_transfers(self) -> None:
        if self.transport is None:
            return
        done = self.transport.poll()
        for tid in sorted(done.finished_receiving):  # not the set's order: it varies by process
            self.transport.forget(tid)
            rid = self._by_transfer.get(tid)
            if rid is None:
                if tid in self._cancelling:  # finished just before the cancel landed
                    self.kv.free(self._cancelling.pop(tid))
                continue
            res = self._reserved[rid]
            res.received = True
            self._maybe_begin(rid, res)
        for tid, cause in done.failed.items():
            self.transport.forget(tid)
            if tid in self._cancelling:
                self.kv.free(self._cancelling.pop(tid))
                continue
            rid = self._by_transfer.get(tid)
            if rid is None:
                continue
            if cause is not FailureCause.CANCELLED:  # a sender's cancel is the request ending, not a fault
                self.transfers_failed += 1
                log.warning("%s: KV transfer failed (%s); recomputing here if it goes on", rid, cause.value)
            self.kv.free(rid)
            res = self._reserved[rid]
            res.failed = True
            self._maybe_begin(rid, res)

    def _maybe_begin(self, rid: str, res: Reservation) -> None:
        if res.first is None or not (res.received or res.failed):
            return
        del self._reserved[rid]
        self._by_transfer.pop(res.transfer_id, None)
        req = self._requests[rid]
        token, cached = res.first
        req.append_token(token)
        req.num_cached_tokens = cached
        self._emitted[rid] = 1
        if res.received:
            req.num_computed_tokens = req.num_prompt_tokens
            self.kv.cache_computed_blocks(req)
        else:
            self.recomputed += 1

        def schedule() -> None:
            if res.received:
                self.scheduler.decode.add(req)
            else:
                self.scheduler.prefill.add_preempted(req)

        try:
            self.gate.hold(req, schedule)  # the first token is replayed against the grammar
        except InvalidRequestError as e:
            self._drop_held(rid)
            self._errors.append(error_delta(rid, str(e)))

    # -- stepping ----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._launched is not None or bool(self._errors)

    @property
    def has_pending_io(self) -> bool:
        settling = self.transport is not None and self.transport.settling
        return bool(self._reserved or self._cancelling or self._pending or self.gate or settling)

    @property
    def idle(self) -> bool:
        return not self._requests and not self._cancelling and not self._pending and self._launched is None

    def request_state(self) -> dict[str, int]:
        return {
            **self.kv.request_state(),
            "requests": len(self._requests),
            "emitted": len(self._emitted),
            "reserved": len(self._reserved),
            "by_transfer": len(self._by_transfer),
            "cancelling": len(self._cancelling),
            "pending_reservations": len(self._pending),
            "grammar_wait": len(self.gate),
            "runner": self.rt.runner.kept_requests(),
            **self._transport_state(),
        }

    def step(self) -> list[TokenDelta]:
        self._poll_transfers()
        if self._pending:
            self._serve_pending()
        for req, why in self.gate.poll() if self.gate else ():
            self._drop_held(req.request_id)
            self._errors.append(error_delta(req.request_id, why))
        deltas: list[TokenDelta] = []
        if self._errors:
            deltas, self._errors = self._errors, []
        if self._launched is not None:
            running = self._launched
            ahead = self.scheduler.schedule_ahead()
            self._launched = self._launch(ahead) if ahead is not None else None
            deltas = self._finish(running)
            if self._launched is not None:
                return deltas
        if not self.scheduler.has_work:
            return deltas
        plan = self.scheduler.schedule()
        if plan.empty:
            return deltas
        launched = self._launch(plan)
        if self.overlap and all(self.scheduler.decode.is_scheduled(c.request_id) for c in plan.chunks):
            # Only the decode scheduler's rows keep their blocks from the pool while a step may
            # write them: a prompt's last chunk (one token, say) must be read before an abort.
            self._launched = launched
            return deltas
        return deltas + self._finish(launched)

    def _launch(self, plan: SchedulePlan) -> LaunchedStep:
        owners = {c.request_id: self._requests[c.request_id] for c in plan.chunks}
        return LaunchedStep(plan, self.rt.runner.launch(plan.chunks, self._requests), owners)

    def _finish(self, step: LaunchedStep) -> list[TokenDelta]:
        """Read a launched step's tokens, apply them, and report what they added."""
        result = step.handle.result()
        update = self.scheduler.update(step.plan, result.sampled)
        deltas: list[TokenDelta] = []
        for rid in result.sampled:
            req = self._requests.get(rid)
            if req is None or req is not step.owners[rid]:
                continue  # ended (or aborted, and its id re-used) since the step was planned
            lp = result.logprobs.get(rid)
            deltas.append(self._delta(req, [lp] if lp is not None else []))
        for req in update.finished:
            self._requests.pop(req.request_id, None)
            self._emitted.pop(req.request_id, None)
            self.rt.runner.release(req.request_id)
        if self._pending and update.finished:
            self._serve_pending()
        return deltas

    def _delta(self, req: Request, logprobs: list[Logprob]) -> TokenDelta:
        since = self._emitted[req.request_id]
        self._emitted[req.request_id] = len(req.output_token_ids)
        return delta_for(req, since, logprobs)

    def counts(self) -> tuple[int, int]:
        # A granted reservation holds its blocks and joins the batch when its KV is in: it is
        # running work, not a request queued for room (which the goodput policy charges as a
        # wait on every request routed here). Pending reservations do wait for room.
        running = self.scheduler.num_running + len(self._reserved)
        return running, self.scheduler.num_waiting + len(self._pending)
