"""The router's workers coming and going, and the request migration that causes.

``Membership`` is the router's part (``pdserve.router.service``) that changes which workers
serve (``Pools``): a worker joins (``add_worker``), is lost (its channel ended, ``_on_lost``), is
retired (``retire``) or moves to the other pool in place (``switch_role``). Whatever a worker
that leaves still held moves elsewhere (``_migrate``: a fresh internal id, dispatched again
with the tokens already sent) or fails with the reason. Whenever the prefill pool gains a
worker or starts to lose one (retired, switching role, draining), the prompts that have not
started are spread over the pool again (``_rebalance_prefill``, deciding with ``pdserve.router.rebalance``).

Every method runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pdserve.model_runtime.validation import RequestLimits
from pdserve.router.accounting import Accounting
from pdserve.router.config import RouterConfig
from pdserve.router.errors import Code, RouterError
from pdserve.router.lifecycle import why_not_migrate
from pdserve.router.outputs import OutputListener
from pdserve.router.policy import Decision, RouteRequest
from pdserve.router.pools import Pools
from pdserve.router.prefix import block_keys
from pdserve.router.rebalance import Queued, Waiting, queue_of, withdrawals
from pdserve.router.request_flow import RequestFlow
from pdserve.router.stream import RequestStream
from pdserve.router.workers import Leaving, WorkerHandle, WorkerLost, attached
from pdserve.worker.commands import Release, Withdraw
from pdserve.worker.control import SetLeaving, SwitchRole
from pdserve.worker.messages import WorkerHealth, WorkerInfo, WorkerRole

if TYPE_CHECKING:
    from pdserve.router.service import ModelInfo

log = logging.getLogger("pdserve.router.service")

# (route, remote_prefill, avoid) -> where a request goes (``Router.decide``)
Decide = Callable[[RouteRequest, bool, str], Decision]


@dataclass(frozen=True)
class PoolChange:
    """What one planned change of a worker (``Membership.retire``, ``Membership.switch_role``) did."""

    worker_id: str
    done: bool  # it left its pool: retired, or serving in its new role
    moved: int = 0  # requests it still held when its drain ran out, moved to other workers
    why_not: str = ""  # (not done) why the change was given up

    @property
    def clean(self) -> bool:
        """Done, and nothing had to move."""
        return self.done and not self.moved


class Membership:
    def __init__(
        self,
        config: RouterConfig,
        pools: Pools,
        outputs: OutputListener,
        limits: RequestLimits,
        model: ModelInfo,
        accounting: Accounting,
        flow: RequestFlow,
        streams: dict[str, RequestStream],
        client_ids: dict[str, str],
        decide: Decide,
    ) -> None:
        self.config = config
        self.pools = pools
        self.workers = pools.workers
        self.outputs = outputs
        self.limits = limits
        self.model = model
        self.accounting = accounting
        self.metrics = accounting.metrics
        self.dispatcher = accounting.dispatcher
        self.flow = flow
        self._streams = streams  # the router's, by its own request id
        self._client_ids = client_ids  # the router's: the client's request id -> its own
        self._decide = decide
        self._rebalancing = asyncio.Lock()  # one rebalance at a time: each plans on the last one's outcome
        # Told of every worker the router lost, once its requests have moved (a pool keeper
        # replaces it).
        self.on_worker_gone: Callable[[WorkerHandle, str], None] | None = None
        # Told of every worker that began to drain after SIGTERM (a pool keeper starts its
        # replacement at once); None: no replacement comes, so none is waited for.
        self.on_worker_leaving: Callable[[WorkerHandle], None] | None = None
        self.releases = True  # False on a router replica (``attach``): the owner releases workers

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.flow.spawn(coro)

    def add_worker(self, worker: WorkerHandle, replaces: str = "") -> None:
        """Take a worker in at run time (a replacement, a grown pool); it gets requests once its
        channel is up. ``replaces``: a lost worker it stands in for, dropped from the list now.
        Raises ``ValueError`` if it cannot serve this deployment's requests."""
        wid, info, ref = worker.worker_id, worker.info, self.model
        if wid in self.workers:
            raise ValueError(f"worker {wid!r} is already registered")
        if worker.role not in self.pools.roles:
            raise ValueError(
                f"worker {wid!r}: a {worker.role.value} worker in a deployment of {self.pools.roles}"
            )
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

    def attach(self, info: WorkerInfo) -> None:
        """A router replica takes in a worker the pool owner started, from the info frame its
        channel opens with: a new worker, or one whose channel to this replica ended and came
        back (what it held for this replica was moved off when it ended, and the worker
        aborted it). Raises ``ValueError`` if it cannot serve this deployment's requests."""
        old = self.workers.get(info.worker_id)
        if old is not None and not old.alive:
            del self.workers[info.worker_id]
        self.add_worker(attached(info))

    def switched(self, worker: WorkerHandle, info: WorkerInfo) -> None:
        """A router replica hears that the pool owner switched ``worker``'s role (the owner
        drained it of every router's requests first; anything this replica still had there
        moves, as off a worker that left)."""
        self._move_off(worker, f"worker {worker.worker_id} switched role", planned=True)
        worker.info, worker.role = info, info.role
        worker.load = replace(worker.load, role=info.role, address=info.address)
        log.info("worker %s is now a %s worker", worker.worker_id, info.role.value)
        self.on_pool_change(worker)

    def on_pool_change(self, worker: WorkerHandle) -> None:
        """Whether ``worker`` takes requests changed: its channel came up, or it is draining
        (told to stop after SIGTERM: its replacement starts now, and it takes nothing new once
        another worker of its role does)."""
        if worker.held and self.on_worker_leaving is not None:
            self.on_worker_leaving(worker)
        self._release_drained()
        if worker.role is WorkerRole.PREFILL:
            self._spawn(self._rebalance_prefill())
        else:
            self._keep_a_decoder()

    def _release_drained(self) -> None:
        """Send ``Release`` to every worker draining after SIGTERM that new requests no longer
        need: another worker of its role takes requests, its role is not the one that decodes
        (decode workers prefill themselves), or no replacement is coming for it. A router
        replica sends none (``releases``): letting a worker go is the pool owner's call."""
        if not self.releases:
            return
        for w in self.workers.values():
            needed = (
                w.role is self.pools.decode_role
                and not self.pools.routable(w.role)
                and self.on_worker_leaving
            )
            if w.held and not needed:
                w.released = True
                self._spawn(self._let_go(w))

    async def _let_go(self, w: WorkerHandle) -> None:
        try:
            await w.command(Release(), self.config.call_timeout_s)
        except (WorkerLost, asyncio.TimeoutError) as e:  # gone: nothing to release
            log.debug("release of %s: %s", w.worker_id, e)

    async def on_lost(self, worker: WorkerHandle, reason: str) -> None:
        self._keep_a_decoder()  # first: what the lost worker held may need the worker it keeps
        self._move_off(worker, f"worker {worker.worker_id} failed: {reason}")
        # Its channel is gone, but the process may live on (a broken connection, a wedged
        # pusher): stop it, or it keeps computing requests nobody collects.
        self._spawn(self._stop_worker(worker))
        if self.on_worker_gone is not None and not worker.retiring:
            self.on_worker_gone(worker, reason)

    def _move_off(self, worker: WorkerHandle, why: str, planned: bool = False) -> None:
        """Whatever ``worker`` (lost, or leaving by a planned change) still held goes elsewhere
        or fails with ``why``."""
        self.dispatcher.on_worker_lost(worker.worker_id)
        for rid in list(worker.inflight):
            stream = self._streams.get(rid)
            if stream is None or stream.done:
                continue  # ended already (its consumer has yet to clean up): nothing to move
            # Decode lost, or prefill lost before the first token: the stream moves (or fails);
            # prefill lost after it: decode recomputes the prompt.
            self.flow.worker_lost(stream, worker, why, planned)
        leftover, worker.inflight = worker.inflight, set()
        for rid in leftover:  # (a worker switching role): it lets go of what it still holds
            self.flow.abort_on(worker, rid)

    # -- planned changes -----------------------------------------------------------------------
    async def _drain(self, worker_id: str, drain_timeout_s: float) -> WorkerHandle:
        """Route nothing more to the worker and wait up to ``drain_timeout_s`` (with migration
        off: however long it takes) for the requests it holds to end, or for the change to be
        given up (``_keep_a_decoder``). Raises ``ValueError`` for an unknown or lost worker, or
        one already being taken out of service."""
        w = self.workers.get(worker_id)
        if w is None or not w.alive or w.retiring:
            raise ValueError(f"no live worker {worker_id!r} in service")
        w.leaving, w.kept_because = Leaving.DRAINING, ""
        if w.role is WorkerRole.PREFILL:  # its prompts that have not started go elsewhere now
            self._spawn(self._rebalance_prefill())
        await self._tell_leaving(w, True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while (
            (w.inflight or self._foreign(w))
            and w.alive
            and w.leaving is Leaving.DRAINING
            and (loop.time() < deadline or self.config.migration_limit <= 0)
        ):
            await asyncio.sleep(0.05)
        return w

    def _foreign(self, w: WorkerHandle) -> int:
        """Requests router replicas placed on ``w`` (as its last load says; 0 without them)."""
        if self.config.routers <= 1:
            return 0
        return w.load.others.prefills + w.load.others.decodes

    async def _tell_leaving(self, w: WorkerHandle, leaving: bool) -> None:
        """Router replicas learn that a planned change takes ``w`` out of its pool (or gave that
        up) from its own loads only: tell the worker (``SetLeaving``). Nothing to tell with one
        router, which knows it already."""
        if self.config.routers <= 1 or not w.alive:
            return
        try:
            await w.control(SetLeaving(leaving), timeout_s=self.config.call_timeout_s)
        except (WorkerLost, asyncio.TimeoutError) as e:  # gone: its channel's end says the rest
            log.debug("%s leaving=%s: %s", w.worker_id, leaving, e)

    def _keep_a_decoder(self) -> None:
        """A planned change must not leave the deployment without a worker that decodes: when
        no worker of that role takes requests and one is draining for a change (retired, or
        switching to prefill), the change is given up and it takes requests again, so the
        streams of a worker lost meanwhile move to it rather than fail. Checked whenever a
        worker of that role is lost or stops taking requests, not only when the change begins."""
        role = self.pools.decode_role
        if self.pools.routable(role):
            return
        draining = [
            w for w in self.workers.values()
            if w.role is role and w.leaving is Leaving.DRAINING and w.health is WorkerHealth.HEALTHY
            and w.channel is not None
        ]  # fmt: skip
        if not draining:
            return
        w = max(draining, key=lambda h: (len(h.inflight), h.worker_id))  # keeps the most where it is
        w.leaving = Leaving.STAYING
        w.kept_because = f"no other {role.value} worker takes requests"
        log.warning("worker %s stays in the %s pool: %s", w.worker_id, role.value, w.kept_because)

    def _given_up(self, w: WorkerHandle) -> PoolChange | None:
        """The change of ``w`` when it was given up during its drain, or must be now (the last
        worker that decodes); None when it goes on."""
        if w.alive and w.leaving is Leaving.DRAINING:
            self._keep_a_decoder()
        if w.leaving is Leaving.STAYING:
            self._spawn(self._tell_leaving(w, False))
            return PoolChange(w.worker_id, done=False, why_not=w.kept_because)
        return None

    async def switch_role(self, worker_id: str, role: WorkerRole, drain_timeout_s: float) -> PoolChange:
        """Move a worker to the other pool in place (it keeps its weights and KV pool): route
        nothing more to it, let its requests finish for up to ``drain_timeout_s``, move what is
        left to other workers, switch it, and route to it in its new role. The change is given
        up (``done`` False) if, while it drains, it becomes the last worker that decodes.
        Raises ``ValueError`` for a role this deployment has no pool for, or when the worker is
        the last one that decodes."""
        w = self.workers.get(worker_id)
        if w is not None and (role not in self.pools.roles or role is w.role):
            raise ValueError(f"worker {worker_id!r} cannot switch from {w.role.value} to {role.value} here")
        if (
            w is not None
            and w.role is self.pools.decode_role
            and self.pools.routable(self.pools.decode_role) == [w]
        ):
            raise ValueError(f"worker {worker_id!r} is the last {w.role.value} worker")
        w = await self._drain(worker_id, drain_timeout_s)
        if w.alive and w.leaving is Leaving.DRAINING and self._foreign(w):
            # Their router replicas' requests cannot move from here, and a worker switches
            # only when idle: it stays, and serves them on.
            w.leaving = Leaving.STAYING
            w.kept_because = f"router replicas still hold {self._foreign(w)} request(s) on it"
        kept = self._given_up(w)
        if kept is not None:
            return kept
        moved = len(w.inflight)
        w.leaving = Leaving.COMMITTED
        try:
            if w.alive:  # (its history in the old role goes with it: _move_off forgets it)
                self._move_off(w, f"worker {worker_id} is switching role", planned=True)
            deadline = asyncio.get_running_loop().time() + self.config.call_timeout_s
            while True:  # the aborts of what moved may still be on their way
                try:
                    info = await w.control(SwitchRole(role), timeout_s=self.config.call_timeout_s)
                    break
                except ValueError:
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.01)
            w.info, w.role = info, info.role
            w.load = replace(w.load, role=info.role, address=info.address)
            await self._tell_leaving(w, False)  # (before it stays: a DRAINING load is no SIGTERM)
        finally:
            w.leaving = Leaving.STAYING
        if w.role is WorkerRole.PREFILL:
            self._spawn(self._rebalance_prefill())
        log.info("worker %s is now a %s worker%s", worker_id, role.value, _moved(moved))
        return PoolChange(worker_id, done=True, moved=moved)

    async def retire(self, worker_id: str, drain_timeout_s: float) -> PoolChange:
        """Take a worker out of service without failing a request: route nothing more to it, let
        the requests it holds finish for up to ``drain_timeout_s``, move what is left to other
        workers (migration), then stop it (its process and, on Ray, its placement group go).
        The change is given up (``done`` False, the worker serves on) if, while it drains, it
        becomes the last worker that decodes. See ``_drain`` for the errors."""
        w = await self._drain(worker_id, drain_timeout_s)
        kept = self._given_up(w)
        if kept is not None:
            return kept
        moved = len(w.inflight)
        w.leaving = Leaving.COMMITTED
        if w.alive:  # (else it was lost meanwhile, and its requests moved then)
            w.mark_lost()  # its channel's end is no loss now: nothing to replace
            self._move_off(w, f"worker {worker_id} was retired", planned=True)
        if self.workers.get(worker_id) is w:
            del self.workers[worker_id]
        await self._stop_worker(w)
        log.info("worker %s retired%s", worker_id, _moved(moved))
        return PoolChange(worker_id, done=True, moved=moved)

    # -- prompts that have not started ---------------------------------------------------------
    async def _rebalance_prefill(self) -> None:
        """Take back the prompts ``withdrawals`` picks (each worker answers for its own: one
        that started stays) and route them again, as new requests are routed."""
        if self.pools.colocated or not self.config.rebalance_prefill:
            return
        async with self._rebalancing:
            pool = [w for w in self.workers.values() if w.role is WorkerRole.PREFILL and w.alive]
            open_workers = [w.worker_id for w in pool if w.routable]
            min_tokens = min((w.info.step_tokens for w in pool if w.routable), default=0)
            plan = withdrawals({w.worker_id: self._queued(w) for w in pool}, open_workers, min_tokens)
            await asyncio.gather(*(self._withdraw(self.workers[wid], rids) for wid, rids in plan.items()))

    def _queued(self, w: WorkerHandle) -> list[Queued]:
        """``w``'s prompts without a first token, oldest first (as far as the router knows)."""
        streams = [self._streams.get(rid) for rid in w.inflight]
        waiting = [
            Waiting(s.request_id, s.attempt_at, s.arrival, len(s.prompt_ids), _ttft_target(s))
            for s in streams
            if s is not None and not s.done and s.first_token is None and s.prefill_worker == w.worker_id
        ]
        return queue_of(waiting, time.perf_counter())

    async def _withdraw(self, w: WorkerHandle, request_ids: list[str]) -> None:
        timeout = self.config.call_timeout_s
        answers = await asyncio.gather(
            *(w.command(Withdraw(rid), timeout) for rid in request_ids), return_exceptions=True
        )
        # oldest first: routed again in the order they came
        for rid, taken in reversed(list(zip(request_ids, answers, strict=True))):
            if taken is not True:
                continue  # started, ended, moved on, or the worker is gone (its loss moves it)
            stream = self._streams.get(rid)
            if stream is None or stream.done:
                w.inflight.discard(rid)  # the worker forgot it: nothing to abort there
                continue
            self.flow.forget(stream, w)
            self.metrics.rerouted.inc()
            self._restart(stream, avoid=w.worker_id)

    # -- migration -----------------------------------------------------------------------------
    def relocate(self, stream: RequestStream, why: str, planned: bool = False) -> None:
        """``stream``'s worker is gone (``why``): move it, or fail it saying why it cannot move."""
        has_decoders = bool(self.pools.decoders())
        limit, role = self.config.migration_limit, self.pools.decode_role.value
        why_not = why_not_migrate(stream.fault_migrations, limit, has_decoders, planned, role)
        if why_not is None:
            self._migrate(stream, planned)
        else:
            stream.fail(RouterError(Code.UNAVAILABLE, f"{why}; {why_not}"))

    def _migrate(self, stream: RequestStream, planned: bool = False) -> None:
        """Move a stream to another worker (``_restart``); a move caused by a fault (not
        ``planned``) counts against the limit."""
        stream.migrations += 1
        if not planned:
            stream.fault_migrations += 1
        self.metrics.migrations.labels(cause="planned" if planned else "lost").inc()
        self._restart(stream)

    def _restart(self, stream: RequestStream, avoid: str = "") -> None:
        """Dispatch a stream again: whatever was under way for it stops (its dispatch; it is
        aborted on the workers that live on and still hold it), it takes a fresh id (so
        nothing the old workers still send can reach it), and it goes to a decode worker that
        recomputes prompt + the tokens already sent and goes on, or, when no token was sent
        yet, the way any new request is routed (to a prefill worker other than ``avoid``: one
        that gave the prompt back, which the dispatcher's last view of it may still favour)."""
        old = stream.request_id
        self.flow.release(stream)
        self.accounting.dropped(old)  # the dispatcher forgets the old placement
        new = f"req-{uuid.uuid4().hex}"
        del self._streams[old]
        self._streams[new] = stream
        if self._client_ids.get(stream.client_id) == old:
            self._client_ids[stream.client_id] = new
        stream.restart(new)
        self._spawn(self._resume(stream, avoid))

    async def _resume(self, stream: RequestStream, avoid: str) -> None:
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
            decision = self._decide(route, not sent, avoid)
        except RouterError as e:
            stream.fail(e)
            return
        log.info("%s: moving to %s+%s after %d tokens (migrations: %d)", stream.client_id,
                 decision.prefill_worker or "-", decision.decode_worker, len(sent),
                 stream.migrations)  # fmt: skip
        self.flow.start(stream, work, decision)

    async def _stop_worker(self, worker: WorkerHandle) -> None:
        try:
            await asyncio.to_thread(worker.caller.kill)
        except Exception as e:  # already gone is the common case
            log.debug("stopping lost worker %s: %s", worker.worker_id, e)


def _moved(n: int) -> str:
    return f" ({n} request(s) moved)" if n else ""


def _ttft_target(stream: RequestStream) -> float:
    return stream.slo.ttft_ms if stream.slo is not None else 0.0
