"""The router's core, shared by the gRPC and HTTP front ends.

``Router.admit`` checks a request and ``Router.run`` turns it into a stream of events::

    tokenize + validate (caps) -> SLO class -> dispatcher decides (decode worker, prefill worker
                   or local prefill, or REJECTED -> RESOURCE_EXHAUSTED with a retry hint)
    remote prefill: prefill.prefill and decode.queue_reservation(blocks) at once -> prefill.set_target(KV
                   target) -> first token from prefill -> decode.start(first token) -> decode's
                   tokens (all worker outputs arrive over ``pdserve.router.outputs``)
    local prefill (colocated, or conditional disaggregation): decode.add_local -> decode's tokens
    client gone / deadline / stop string -> abort on every worker that holds the request
    end -> judged against its SLO class (metrics, /dashboard), dispatcher told

Contract: when ``run``'s iterator ends, however it ends, no worker still works on the
request (aborts are sent; workers free the blocks). A worker that dies fails exactly the
requests it held, with UNAVAILABLE; later requests go to the survivors.

Request ids: the router mints its own id for every request; that id, never the client's, is
what workers, the dispatcher and the output channel see. A client's ``request_id`` is only
echoed back (and names the request for ``abort``), so no choice of a client's reaches another
request's state on a worker.

Commands (``pdserve.worker.commands``) go over each worker's own channel and run there in the
order they were sent, so an ``Abort`` never overtakes the command that added its request, and
workers keep no record of ids they never saw.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.model_runtime.validation import RequestLimits, validate_request
from pdserve.router.accounting import Accounting
from pdserve.router.config import RouterConfig
from pdserve.router.errors import Code, RouterError
from pdserve.router.outputs import OutputListener
from pdserve.router.policy import Decision, Outcome, RouteRequest
from pdserve.router.prefix import block_keys
from pdserve.router.slo import SloClass, SloHint
from pdserve.router.stream import Event, RequestStream
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
from pdserve.worker.messages import (
    KVTarget,
    TokenDelta,
    WorkerHealth,
    WorkerLoad,
    WorkerRole,
    WorkItem,
)

log = logging.getLogger(__name__)
__all__ = ["Admitted", "GenerateInput", "ModelInfo", "Router", "SloHint"]

MAX_CLIENT_ID_CHARS = 256  # a client's request id is echoed back and kept while in flight


@dataclass(frozen=True)
class GenerateInput:
    prompt: str | Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    slo: SloHint = field(default_factory=SloHint)


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    architecture: str
    max_context_length: int
    vocab_size: int
    block_size: int
    dtype: str
    max_prompt_tokens: int
    max_tokens_cap: int
    max_logprobs: int


@dataclass(frozen=True)
class Admitted:
    stream: RequestStream
    work: WorkItem
    decision: Decision
    slo: SloClass

    @property
    def request_id(self) -> str:
        return self.stream.request_id


class Router:
    def __init__(
        self,
        config: RouterConfig,
        workers: Sequence[WorkerHandle],
        tokenizer: TextTokenizer | None,
        outputs: OutputListener,
        colocated: bool = False,
    ) -> None:
        if not workers:
            raise ValueError("a router needs workers")
        self.config = config
        self.colocated = colocated
        self.outputs = outputs
        self.workers = {w.worker_id: w for w in workers}
        self.tokenizer = tokenizer
        self._streams: dict[str, RequestStream] = {}  # by the router's own request id
        self._client_ids: dict[str, str] = {}  # the client's request id -> the router's
        self._tasks: set[asyncio.Task[None]] = set()
        self.draining = False
        # Told of every worker the router lost, once its requests have moved (a pool keeper
        # replaces it).
        self.on_worker_gone: Callable[[WorkerHandle, str], None] | None = None
        info = workers[0].info
        caps = config.caps
        decode_blocks = min(w.info.kv_blocks for w in workers if w.role is not WorkerRole.PREFILL)
        self.limits = RequestLimits(
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            kv_capacity_blocks=decode_blocks,
            max_logprobs=min(caps.max_logprobs, info.max_logprobs),
            has_tokenizer=tokenizer is not None,
            max_prompt_tokens=caps.max_prompt_tokens,
            max_tokens_cap=caps.max_tokens,
        )
        local = min((w.info.step_tokens for w in workers if w.role is not WorkerRole.PREFILL), default=0)
        remote = min((w.info.step_tokens for w in workers if w.role is WorkerRole.PREFILL), default=0)
        self.accounting = Accounting(config, info.block_size, self._loads, local, remote)
        self.metrics = self.accounting.metrics
        self.dispatcher = self.accounting.dispatcher
        self.slos = self.accounting.slos
        self.slo_tracker = self.accounting.tracker
        name = config.model_name or info.model_dir.rstrip("/").rsplit("/", 1)[-1]
        self.model = ModelInfo(
            model_id=name,
            architecture=info.architecture,
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            dtype=info.dtype,
            max_prompt_tokens=caps.max_prompt_tokens or info.max_model_len - 1,
            max_tokens_cap=caps.max_tokens,
            max_logprobs=self.limits.max_logprobs,
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.outputs.bind(self.workers, self._on_deltas, self._on_lost)

    async def stop(self) -> None:
        for s in list(self._streams.values()):
            s.fail(RouterError(Code.UNAVAILABLE, "the server is shutting down"))
        await self.outputs.close()

    def add_worker(self, worker: WorkerHandle, replaces: str = "") -> None:
        """Take a worker in at run time (a replacement, a grown pool); it gets requests once its
        channel is up. ``replaces``: a lost worker it stands in for, dropped from the list now.
        Raises ``ValueError`` if it cannot serve this deployment's requests."""
        wid, info, ref = worker.worker_id, worker.info, self.model
        if wid in self.workers:
            raise ValueError(f"worker {wid!r} is already registered")
        roles = (self._decode_role,) if self.colocated else (WorkerRole.PREFILL, WorkerRole.DECODE)
        if worker.role not in roles:
            raise ValueError(f"worker {wid!r}: a {worker.role.value} worker in a deployment of {roles}")
        diffs = [
            f"{name} {got!r} (the deployment's: {want!r})"
            for name, got, want in (
                ("architecture", info.architecture, ref.architecture),
                ("vocab_size", info.vocab_size, ref.vocab_size),
                ("block_size", info.block_size, ref.block_size),
                ("max_model_len", info.max_model_len, ref.max_context_length),
                ("dtype", info.dtype, ref.dtype),
            )
            if got != want
        ]
        if worker.role is not WorkerRole.PREFILL and info.kv_blocks < self.limits.kv_capacity_blocks:
            admitted = self.limits.kv_capacity_blocks
            diffs.append(f"kv_blocks {info.kv_blocks} (requests are admitted for {admitted})")
        if diffs:
            raise ValueError(f"worker {wid!r} cannot join: " + ", ".join(diffs))
        old = self.workers.get(replaces)
        if old is not None and not old.alive:
            del self.workers[replaces]
        self.workers[wid] = worker
        self.outputs.registered(wid)
        log.info("worker %s joined%s", wid, f" (replacing {replaces})" if replaces else "")

    def _loads(self) -> list[WorkerLoad]:
        unhealthy = WorkerHealth.UNHEALTHY
        return [w.load if w.alive else replace(w.load, health=unhealthy) for w in self.workers.values()]

    def _pool(self, role: WorkerRole) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.role is role and w.routable]

    @property
    def ready(self) -> bool:
        if self.draining:
            return False
        if self.colocated:
            return bool(self._pool(WorkerRole.COLOCATED))
        # With every prefill worker gone, decode workers prefill requests themselves (slower,
        # but served): the dispatchers fall back to local prefill.
        return bool(self._pool(WorkerRole.DECODE))

    def request_state(self) -> dict[str, int]:
        """Sizes of the router's per-request maps: all zero once no request is in flight (a
        worker's own maps: ``WorkerHost.request_state``)."""
        return {
            "streams": len(self._streams),
            "client_ids": len(self._client_ids),
            "tasks": len(self._tasks),
            "worker_inflight": sum(len(w.inflight) for w in self.workers.values()),
            "commands_waiting": sum(w.channel.waiting for w in self.workers.values() if w.channel),
        }

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait for in-flight requests to finish. True if they all did."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    # -- requests ----------------------------------------------------------------------------
    def prepare(self, inp: GenerateInput) -> tuple[str, tuple[int, ...]]:
        """Tokenize and validate; returns (the router's request id, prompt ids). Raises
        ``RouterError(INVALID_ARGUMENT)`` naming the field."""
        prompt = inp.prompt
        if isinstance(prompt, str):
            if not prompt:
                raise RouterError(Code.INVALID_ARGUMENT, "prompt: must not be empty", "prompt")
            if self.tokenizer is None:
                raise RouterError(
                    Code.INVALID_ARGUMENT, "prompt: this model has no tokenizer; send token ids", "prompt"
                )
            ids = tuple(self.tokenizer.encode(prompt))
        else:
            ids = tuple(prompt)
        try:
            validate_request(ids, inp.params, self.limits)
        except InvalidRequestError as e:
            raise RouterError(Code.INVALID_ARGUMENT, str(e), e.field) from None
        if len(inp.request_id) > MAX_CLIENT_ID_CHARS:
            raise RouterError(
                Code.INVALID_ARGUMENT, f"request_id: at most {MAX_CLIENT_ID_CHARS} characters", "request_id"
            )
        if inp.request_id in self._client_ids:
            raise RouterError(
                Code.INVALID_ARGUMENT, f"request_id: {inp.request_id!r} is already in flight", "request_id"
            )
        return f"req-{uuid.uuid4().hex}", ids

    def admit(self, inp: GenerateInput) -> Admitted:
        """Check a request, route it and take it in (raises ``RouterError`` before anything is
        sent: INVALID_ARGUMENT, UNAVAILABLE, or RESOURCE_EXHAUSTED with ``retry_after_s``)."""
        rid, ids = self.prepare(inp)
        if self.draining:
            raise RouterError(Code.UNAVAILABLE, "the server is draining")
        if len(self._streams) >= self.config.max_inflight:
            raise RouterError(
                Code.RESOURCE_EXHAUSTED, "too many requests in flight; retry later", retry_after_s=1.0
            )
        try:
            slo = self.slos.resolve(inp.slo.slo_class, inp.slo.ttft_ms, inp.slo.tpot_ms)
        except ValueError as e:
            raise RouterError(Code.INVALID_ARGUMENT, f"slo_class: {e}", "slo_class") from None
        keys = block_keys(ids, self.limits.block_size) if self.config.policy == "goodput" else ()
        route = RouteRequest(len(ids), inp.params.max_tokens, inp.slo.priority, rid, keys, slo)
        decision = self._decide(route)
        self.accounting.decided(rid, decision)
        if decision.outcome is Outcome.REJECTED:
            self.accounting.judge(slo, None)
            raise RouterError(
                Code.RESOURCE_EXHAUSTED,
                f"no worker is predicted to meet SLO class {slo.name!r} ({decision.reason}: predicted TTFT"
                f" {decision.predicted_ttft_s * 1e3:.0f} ms, TPOT {decision.predicted_tpot_s * 1e3:.1f} ms);"
                " retry later",
                retry_after_s=decision.retry_after_s,
            )
        stream = RequestStream(rid, ids, inp.params, self.tokenizer, inp.request_id or rid)
        stream.slo = slo
        self._streams[rid] = stream
        self._client_ids[stream.client_id] = rid
        return Admitted(stream, WorkItem(rid, ids, inp.params, decision.priority), decision, slo)

    @property
    def _decode_role(self) -> WorkerRole:
        """The role of the workers that decode (and may prefill) requests."""
        return WorkerRole.COLOCATED if self.colocated else WorkerRole.DECODE

    def _decide(self, route: RouteRequest, remote_prefill: bool = True) -> Decision:
        """Where the request goes; ``remote_prefill=False``: only to a decode worker, which
        prefills it itself."""
        decode = [w.load for w in self._pool(self._decode_role)]
        if not decode:
            raise RouterError(Code.UNAVAILABLE, f"no healthy {self._decode_role.value} worker")
        remote = remote_prefill and not self.colocated
        prefill = [w.load for w in self._pool(WorkerRole.PREFILL)] if remote else []
        return self.dispatcher.decide(route, prefill, decode, time.perf_counter())

    def discard(self, admitted: Admitted) -> None:
        """Forget an admitted request that will not be run (nothing was sent for it)."""
        self._forget(admitted.stream)
        self.accounting.dropped(admitted.request_id)

    def _forget(self, stream: RequestStream) -> None:
        self._streams.pop(stream.request_id, None)
        if self._client_ids.get(stream.client_id) == stream.request_id:
            del self._client_ids[stream.client_id]

    async def run(self, admitted: Admitted) -> AsyncIterator[Event]:
        """Events of an admitted request; see the module docstring for the contract."""
        stream = admitted.stream
        self._start_dispatch(stream, admitted.work, admitted.decision)
        try:
            async for ev in stream.events():
                yield ev
        finally:
            # The current attempt's (a migration cancels the one it replaces).
            if stream.dispatch is not None and not stream.dispatch.done():
                stream.dispatch.cancel()
            stream.reservation_settled.set()  # nobody waits for a reservation of an ended stream
            self._forget(stream)
            if not stream.done:
                stream.abort()
            self._release(stream)
            self.accounting.ended(admitted.slo, stream)

    def generate(self, inp: GenerateInput) -> AsyncIterator[Event]:
        return self.run(self.admit(inp))

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
        if stream.dispatched is None:  # the first attempt's: queueing ends there, whatever moves later
            stream.dispatched = time.perf_counter()

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
        # Prefill goes out first: its call is on the TTFT path, the reservation is not.
        outcomes: tuple[Any, Any] = await asyncio.gather(
            prefill.command(Prefill(work), self.config.call_timeout_s),
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

    async def abort(self, request_id: str) -> bool:
        """Abort the request the client named ``request_id``; False if none is in flight."""
        stream = self._streams.get(self._client_ids.get(request_id, ""))
        if stream is None:
            return False
        stream.abort()
        return True

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

    async def _on_lost(self, worker: WorkerHandle, reason: str) -> None:
        self._move_off(worker, f"worker {worker.worker_id} failed: {reason}")
        # Its channel is gone, but the process may live on (a broken connection, a wedged
        # pusher): stop it, or it keeps computing requests nobody collects.
        self._spawn(self._stop_worker(worker))
        if self.on_worker_gone is not None and not worker.retiring:
            self.on_worker_gone(worker, reason)

    def _move_off(self, worker: WorkerHandle, why: str) -> None:
        """Whatever ``worker`` (lost, or retired) still held goes elsewhere or fails with ``why``."""
        self.dispatcher.on_worker_lost(worker.worker_id)
        for rid in list(worker.inflight):
            stream = self._streams.get(rid)
            if stream is None or stream.done:
                continue  # ended already (its consumer has yet to clean up): nothing to move
            if worker.role is WorkerRole.PREFILL and stream.first_token is not None:
                self._spawn(self._kv_lost(stream))  # decode has the first token: it recomputes
                continue
            why_not = self._why_not_migrate(stream)
            if why_not is None:
                self._migrate(stream)  # decode lost, or prefill lost before the first token
                continue
            stream.fail(RouterError(Code.UNAVAILABLE, f"{why}; {why_not}"))
        leftover, worker.inflight = worker.inflight, set()
        if worker.alive:  # (a worker switching role): it lets go of what it still holds
            for rid in leftover:
                self._spawn(self._abort_on(worker, rid))

    async def _drain(self, worker_id: str, drain_timeout_s: float) -> WorkerHandle:
        """Route nothing more to the worker and wait up to ``drain_timeout_s`` (with migration
        off: however long it takes) for the requests it holds to end. Raises ``ValueError`` for
        an unknown or lost worker, or one already being taken out of service."""
        w = self.workers.get(worker_id)
        if w is None or not w.alive or w.retiring:
            raise ValueError(f"no live worker {worker_id!r} in service")
        w.retiring = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while w.inflight and w.alive and (loop.time() < deadline or self.config.migration_limit <= 0):
            await asyncio.sleep(0.05)
        return w

    async def switch_role(self, worker_id: str, role: WorkerRole, drain_timeout_s: float) -> bool:
        """Move a worker to the other pool in place (it keeps its weights and KV pool): route
        nothing more to it, let its requests finish for up to ``drain_timeout_s``, move what is
        left to other workers, switch it, and route to it in its new role. True if nothing had
        to move. Raises ``ValueError`` for a role this deployment has no pool for, or when the
        worker is the last one that decodes."""
        roles = (WorkerRole.PREFILL, WorkerRole.DECODE) if not self.colocated else (WorkerRole.COLOCATED,)
        w = self.workers.get(worker_id)
        if w is not None and (role not in roles or role is w.role):
            raise ValueError(f"worker {worker_id!r} cannot switch from {w.role.value} to {role.value} here")
        if w is not None and w.role is self._decode_role and self._pool(self._decode_role) == [w]:
            raise ValueError(f"worker {worker_id!r} is the last {w.role.value} worker")
        w = await self._drain(worker_id, drain_timeout_s)
        try:
            clean = not w.inflight
            if w.alive:
                self._move_off(w, f"worker {worker_id} is switching role")
            self.dispatcher.on_worker_lost(worker_id)  # its history in the old role says nothing now
            deadline = asyncio.get_running_loop().time() + self.config.call_timeout_s
            while True:  # the aborts of what moved may still be on their way
                try:
                    info = await w.call("switch_role", role.value, timeout_s=self.config.call_timeout_s)
                    break
                except ValueError:
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.01)
            w.info, w.role = info, info.role
            w.load = replace(w.load, role=info.role, address=info.address)
        finally:
            w.retiring = False
        moved = "" if clean else " (requests moved)"
        log.info("worker %s is now a %s worker%s", worker_id, role.value, moved)
        return clean

    async def retire(self, worker_id: str, drain_timeout_s: float) -> bool:
        """Take a worker out of service without failing a request: route nothing more to it, let
        the requests it holds finish for up to ``drain_timeout_s``, move what is left to other
        workers (migration), then stop it (its process and, on Ray, its placement group go).
        True if nothing had to move (see ``_drain`` for the errors)."""
        w = await self._drain(worker_id, drain_timeout_s)
        clean = not w.inflight
        if w.alive:  # (else it was lost meanwhile, and its requests moved then)
            w.mark_lost()  # its channel's end is no loss now: nothing to replace
            self._move_off(w, f"worker {worker_id} was retired")
        if self.workers.get(worker_id) is w:
            del self.workers[worker_id]
        await self._stop_worker(w)
        log.info("worker %s retired%s", worker_id, "" if clean else " (requests moved)")
        return clean

    # -- migration -----------------------------------------------------------------------------
    def _why_not_migrate(self, stream: RequestStream) -> str | None:
        """Why a stream whose decode worker was lost cannot move to another one (None: it can)."""
        limit = self.config.migration_limit
        if limit <= 0:
            return "request migration is off (--migration-limit 0)"
        if stream.migrations >= limit:
            return f"the stream already moved {stream.migrations} times (--migration-limit {limit})"
        if not self._pool(self._decode_role):
            return f"no healthy {self._decode_role.value} worker is left to move it to"
        return None

    def _migrate(self, stream: RequestStream) -> None:
        """Move a stream off a lost worker: whatever was under way for it stops (its dispatch;
        it is aborted on the workers that live on), it takes a fresh id (so nothing the old
        workers still send can reach it), and it is dispatched again — to a decode worker that
        recomputes prompt + the tokens already sent and goes on, or, when no token was sent yet,
        the way any new request is routed."""
        stream.migrations += 1
        self.metrics.migrations.inc()
        if stream.dispatch is not None and not stream.dispatch.done():
            stream.dispatch.cancel()
        old = stream.request_id
        for wid in (stream.prefill_worker, stream.decode_worker):
            w = self.workers.get(wid)
            if w is not None and old in w.inflight:
                w.inflight.discard(old)
                if w.alive:
                    self._spawn(self._abort_on(w, old))
        self.accounting.dropped(old)  # the dispatcher forgets the old placement
        new = f"req-{uuid.uuid4().hex}"
        del self._streams[old]
        self._streams[new] = stream
        if self._client_ids.get(stream.client_id) == old:
            self._client_ids[stream.client_id] = new
        stream.restart(new)
        self._spawn(self._resume(stream))

    async def _resume(self, stream: RequestStream) -> None:
        assert stream.work is not None
        if stream.done or self._streams.get(stream.request_id) is not stream:
            return  # it ended (or its consumer left) before it could move
        sent = tuple(stream.token_ids)
        work = replace(stream.work, request_id=stream.request_id, output_token_ids=sent)
        context = stream.prompt_ids + sent
        keys = block_keys(context, self.limits.block_size) if self.config.policy == "goodput" else ()
        remaining = stream.params.max_tokens - len(sent)
        route = RouteRequest(len(context), remaining, work.priority, stream.request_id, keys, stream.slo)
        try:
            # Tokens already sent are recomputed where decoding goes on; a prompt alone may be
            # prefilled anywhere, like a new request's.
            decision = self._decide(route, remote_prefill=not sent)
        except RouterError as e:
            stream.fail(e)
            return
        log.info("%s: moving to %s after %d tokens (migration %d)", stream.client_id, decision.decode_worker,
                 len(sent), stream.migrations)  # fmt: skip
        self._start_dispatch(stream, work, decision)

    async def _stop_worker(self, worker: WorkerHandle) -> None:
        try:
            await asyncio.to_thread(worker.caller.kill)
        except Exception as e:  # already gone is the common case
            log.debug("stopping lost worker %s: %s", worker.worker_id, e)

    # -- status ------------------------------------------------------------------------------
    async def cluster_status(self) -> tuple[bool, str, list[WorkerLoad]]:
        """Fresh loads from every worker (a short call each); unreachable ones as UNHEALTHY."""

        async def one(w: WorkerHandle) -> WorkerLoad:
            if w.alive:
                try:
                    w.load = await w.call("load", timeout_s=2.0)
                    return w.load
                except Exception as e:
                    log.warning("status of %s: %s", w.worker_id, e)
            return replace(w.load, health=WorkerHealth.UNHEALTHY)

        loads = await asyncio.gather(*(one(w) for w in self.workers.values()))
        mode = "colocated" if self.colocated else "disaggregated"
        return self.ready, mode, sorted(loads, key=lambda x: x.worker_id)


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
