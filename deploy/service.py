"""One deployment end to end: worker pools (Ray or in-process) + router + HTTP/gRPC front ends.

``Service`` is what ``pdserve serve`` runs; ``ServiceThread`` runs the same thing on a
background event loop so tests and benchmarks can drive it from synchronous code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pdserve.deploy.keeper import PoolKeeper
from pdserve.deploy.pools import PoolSpec
from pdserve.deploy.replicas import ReplicaSet
from pdserve.kvtransfer.config import NODE_ADDRESS
from pdserve.kvtransfer.tls import InternalTls
from pdserve.model_runtime.checkpoint import Checkpoint
from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.model.loader import check_checkpoint
from pdserve.model_runtime.parallel.sharding import ShardingError, check_degree, shape_of
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.chat import ChatTemplate
from pdserve.router.config import RouterConfig
from pdserve.router.constraint_check import ConstraintChecker
from pdserve.router.membership import PoolChange
from pdserve.router.outputs import OutputListener
from pdserve.router.replica import ReplicaSpec
from pdserve.router.server import Frontends
from pdserve.router.service import Router
from pdserve.router.tls import load_tls
from pdserve.router.workers import WorkerHandle
from pdserve.worker.control import Shutdown
from pdserve.worker.messages import WorkerRole
from pdserve.worker.spec import WorkerSpec

if TYPE_CHECKING:
    from pdserve.deploy.ray_instance import RayWatch
    from pdserve.deploy.ray_pools import Placement


log = logging.getLogger(__name__)
LOST_STEP_S = 2.0  # each step of a stop whose Ray instance is gone


@dataclass(frozen=True)
class Endpoints:
    http: str  # base URL, e.g. http://127.0.0.1:8000
    grpc: str  # host:port


def _check_model(checkpoint: Checkpoint, spec: PoolSpec) -> TextTokenizer | None:
    """The model's files and configuration, and each pool's degree against its heads."""
    config = check_checkpoint(checkpoint)
    if spec.engine.compute == "model":
        for role, _ in spec.roles:
            flag = "--prefill-tp" if role is WorkerRole.PREFILL else "--decode-tp"
            try:
                check_degree(shape_of(config), spec.tp_of(role), what=flag)
            except ShardingError as e:
                raise ModelLoadError(str(e)) from None
    return TextTokenizer.load(checkpoint)


class Service:
    def __init__(
        self, spec: PoolSpec, config: RouterConfig, use_ray: bool = True, ray_address: str | None = None
    ) -> None:
        self.spec = spec
        self.config = config
        self.use_ray = use_ray
        self.ray_address = ray_address
        self.handles: list[WorkerHandle] = []  # the deployment's workers (replacements join)
        self.router: Router | None = None
        self.frontends: Frontends | None = None
        self.keeper: PoolKeeper | None = None
        self._secret = secrets.token_bytes(32)
        self._tls = InternalTls.generate() if spec.internal_tls else None
        self._channel_address = ""  # host:port the workers connect to (the router's channel)
        self._placement: Placement | None = None
        self._owns_ray = False
        self._stopping = threading.Event()
        # One change per pool at a time (each counts the workers the last one left); the pools
        # change side by side, so one pool's growth never waits out the other's start or drain.
        self._resizing = {role: asyncio.Lock() for role in WorkerRole}
        self._outputs: OutputListener | None = None
        self.replicas: ReplicaSet | None = None  # ``--routers N`` > 1: the router replicas
        self.ray_lost = ""  # why the Ray instance went away under the deployment ("": it did not)
        self.on_ray_lost: Callable[[str], None] | None = None  # told once, with why
        self._ray_watch: RayWatch | None = None
        self._ray_lost_event = asyncio.Event()

    @property
    def channel_address(self) -> str:
        """Where workers reach the router ("host:port"; "" before ``start``)."""
        return self._channel_address

    async def start(self, progress: bool = False) -> Endpoints:
        # The router reads the model's tokenizer and configuration too: doing it first turns a
        # wrong path or config into an error before any worker (or Ray) starts.
        checkpoint = resolve_model(self.spec.engine.model)
        tokenizer = await asyncio.to_thread(_check_model, checkpoint, self.spec)
        tls = load_tls(self.config.tls) if self.config.tls is not None else None
        routers = self.config.routers
        # The front ends' ports first: a taken port fails now, not after Ray and the workers
        # started, and nothing those start can take it meanwhile. (Router replicas serve them:
        # this process holds them for the replicas.)
        self.frontends = frontends = Frontends(self.config, tls, shared_ports=routers > 1)
        if self.use_ray:
            from pdserve.deploy.ray_instance import (
                RayWatch,
                control_plane,
                keep_python_signal_handlers,
                start_ray,
            )
            from pdserve.deploy.ray_pools import Placement

            starting = asyncio.ensure_future(
                asyncio.to_thread(start_ray, self.ray_address, self.spec.capacity * self.spec.cpus_per_worker)
            )
            try:
                self._owns_ray = await asyncio.shield(starting)
            except asyncio.CancelledError:
                # Stopped while Ray starts: let it finish, so that ``stop`` knows to shut it down.
                self._owns_ray = await starting
                raise
            finally:
                keep_python_signal_handlers()
            self._placement = Placement.of(self.spec)
            loop = asyncio.get_running_loop()
            self._ray_watch = RayWatch(
                control_plane(), lambda why: loop.call_soon_threadsafe(self._ray_gone, why)
            )
            self._ray_watch.start()
        channel_host = self.config.worker_channel_host
        if channel_host == NODE_ADDRESS:  # where workers on other nodes reach the router
            from pdserve.deploy.pool_worker import node_address

            channel_host = node_address()
        self._outputs = outputs = OutputListener(
            self._secret,
            host=channel_host,
            liveness_timeout_s=self.config.liveness_timeout_s,
            tls=self._tls,
        )
        self._channel_address = await outputs.start()
        if routers > 1:
            self.replicas = ReplicaSet(routers, channel_host)
        specs = self.spec.worker_specs(
            self._secret, self._channel_address, self.use_ray, self._tls, self._replica_addresses
        )
        self.handles = await asyncio.to_thread(self._launch, specs, progress)
        generation = checkpoint.generation_config()
        if generation.defaults.given():
            log.info("sampling defaults from %s: %s", generation.source, generation.defaults.given())
        self.router = Router(
            self.config,
            self.handles,
            tokenizer,
            outputs,
            colocated=self.spec.is_colocated,
            generation=generation.defaults,
            constraints=ConstraintChecker(self.spec.engine.model) if tokenizer is not None else None,
        )
        self.router.start()
        first = {role: n for role, n in self.spec.roles}
        self.keeper = PoolKeeper(
            self.router, outputs, self._launch_one, first, self._joined, replace_lost=self.spec.replace_lost
        )
        await outputs.wait_connected([h.worker_id for h in self.handles], timeout_s=60)
        if self.replicas is not None:
            frontends.chat_template = ChatTemplate.of(tokenizer)
            await self.replicas.start(self._replica_spec)
        else:
            await frontends.start(self.router)
        return self.endpoints

    @property
    def _replica_addresses(self) -> tuple[str, ...]:
        return self.replicas.addresses if self.replicas is not None else ()

    def _replica_spec(self, index: int) -> ReplicaSpec:
        """What router replica ``index`` is told when it (re)starts: the pool as it is now."""
        router, frontends, replicas = self.router, self.frontends, self.replicas
        assert router is not None and frontends is not None and replicas is not None
        config = replace(
            self.config, http_port=frontends.http_port, grpc_port=frontends.grpc_port, router_id=str(index)
        )
        return ReplicaSpec(
            index=index,
            config=config,
            model=self.spec.engine.model,
            colocated=self.spec.is_colocated,
            secret=self._secret,
            internal_tls=self._tls,
            workers=tuple(h.info for h in router.workers.values() if h.alive),
            channel_fd=replicas.replicas[index].channel.fileno(),
        )

    def _launch(
        self, specs: list[WorkerSpec], progress: bool, cancel: threading.Event | None = None
    ) -> list[WorkerHandle]:
        """Start workers (in a thread: it blocks). A launch that finishes after ``stop`` began
        (a signal during start-up cancelled the wait, not the thread) stops its own workers, so
        none is left on a shared cluster; ``cancel`` stops a Ray launch's wait within 0.5 s."""
        if self._placement is not None:
            from pdserve.deploy.ray_pools import launch_workers

            handles = launch_workers(specs, self._placement, 300.0, progress, cancel)
        else:
            from pdserve.deploy.local import launch_local

            handles = launch_local(specs)
        if self._stopping.is_set() or (cancel is not None and cancel.is_set()):
            for h in handles:
                with contextlib.suppress(Exception):
                    h.caller.kill()
            raise RuntimeError("the deployment stopped, or the caller gave up, while these workers started")
        return handles

    async def _launch_one(self, role: WorkerRole, worker_id: str) -> WorkerHandle:
        ws = self.spec.worker_spec(
            role, worker_id, self._secret, self._channel_address, self.use_ray, self._tls,
            self._replica_addresses,
        )  # fmt: skip
        cancel = threading.Event()
        launch = asyncio.ensure_future(asyncio.to_thread(self._launch, [ws], False, cancel))
        try:
            [handle] = await asyncio.shield(launch)
        except asyncio.CancelledError:
            # The caller gave up (a planner's bounded wait, a stop). The launch thread sees
            # ``cancel`` and stops what it started; a launch that had already returned its
            # worker is stopped by the callback. Nothing here awaits, so a second cancellation
            # cannot cut the clean-up short.
            cancel.set()
            launch.add_done_callback(_stop_abandoned)
            raise
        return handle

    def _ray_gone(self, why: str) -> None:
        if self._ray_watch is not None and self._ray_watch.stopped:
            return  # (a look that ended just as the stop began: Ray is being stopped on purpose)
        self.ray_lost = why
        self._ray_lost_event.set()
        log.error("%s", why)
        if self.on_ray_lost is not None:
            self.on_ray_lost(why)

    def _joined(self, worker: WorkerHandle) -> None:
        # Lost workers were stopped when the router let them go; their replacements take their place.
        self.handles = [h for h in self.handles if h.alive] + [worker]

    async def resize(
        self, role: WorkerRole, count: int, drain_timeout_s: float | None = None
    ) -> list[PoolChange]:
        """Grow or shrink pool ``role`` to ``count`` live workers. New workers take requests once
        they are ready; surplus ones (those holding the fewest requests) are retired: drained
        for ``drain_timeout_s`` (default: the pool's drain timeout), what is left moved, then
        stopped, so no request fails. Returns each retirement's outcome (one given up leaves
        the pool larger: see ``Membership.retire``). Raises ``ValueError`` for a size the
        deployment cannot run with (no decode worker, or a role it has no pool for)."""
        async with self._resizing[role]:
            return await self._resize(role, count, drain_timeout_s)

    async def _resize(self, role: WorkerRole, count: int, drain_timeout_s: float | None) -> list[PoolChange]:
        router, keeper = self.router, self.keeper
        assert router is not None and keeper is not None, "not started"
        roles = [r for r, _ in self.spec.roles]
        if role not in roles:
            raise ValueError(f"this deployment has no {role.value} pool (pools: {[r.value for r in roles]})")
        if count < (0 if role is WorkerRole.PREFILL else 1):
            raise ValueError(f"a {role.value} pool of {count} workers cannot serve")
        live = [w for w in router.workers.values() if w.role is role and w.alive and not w.retiring]
        if count > len(live):
            await asyncio.gather(*(keeper.grow(role) for _ in range(count - len(live))))
            return []
        surplus = sorted(live, key=lambda w: len(w.inflight))[: len(live) - count]
        timeout = self.spec.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        changes: list[PoolChange] = await asyncio.gather(
            *(router.membership.retire(w.worker_id, timeout) for w in surplus)
        )
        gone = {c.worker_id for c in changes if c.done}
        self.handles = [h for h in self.handles if h.worker_id not in gone]
        return changes

    def request_capacity(self, workers: int) -> None:
        """On a Ray cluster, ask its autoscaler for room for ``workers`` workers ahead of need
        (best effort: a cluster without an autoscaler, or no Ray at all, needs nothing)."""
        if not self.use_ray:
            return
        from pdserve.deploy.ray_pools import request_capacity

        try:
            request_capacity(self.spec, workers)
        except Exception as e:  # an autoscaler hint must never stop a resize
            log.debug("no autoscaler request: %s", e)

    async def switch_role(
        self, worker_id: str, role: WorkerRole, drain_timeout_s: float | None = None
    ) -> PoolChange:
        """Move one worker to pool ``role`` in place (``Membership.switch_role``): it keeps its
        weights and KV pool, so this takes a drain and well under a second, not a new process."""
        assert self.router is not None, "not started"
        timeout = self.spec.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        worker = self.router.workers.get(worker_id)
        pools = sorted({role} | ({worker.role} if worker is not None else set()), key=lambda r: r.value)
        async with contextlib.AsyncExitStack() as held:  # both pools it changes, in one order
            for pool in pools:
                await held.enter_async_context(self._resizing[pool])
            return await self.router.membership.switch_role(worker_id, role, timeout)

    @property
    def endpoints(self) -> Endpoints:
        assert self.frontends is not None
        host = self.config.host
        http = f"{self.frontends.scheme}://{host}:{self.frontends.http_port}"
        return Endpoints(http, f"{host}:{self.frontends.grpc_port}")

    async def stop(self) -> None:
        """Stop everything this deployment started. Its Ray instance found gone before or while
        it stops (``_ray_gone``), the rest is stopped without Ray (``_stop_without_ray``)."""
        self._stopping.set()
        try:
            if not self.ray_lost:
                stopping = asyncio.ensure_future(self._stop_with_ray())
                lost = asyncio.ensure_future(self._ray_lost_event.wait())
                await asyncio.wait({stopping, lost}, return_when=asyncio.FIRST_COMPLETED)
                lost.cancel()
                if stopping.done():
                    stopping.result()
                    return
                stopping.cancel()  # it waits on Ray, which is gone
                await asyncio.gather(stopping, return_exceptions=True)
            await self._stop_without_ray()
        finally:
            if self._ray_watch is not None:
                self._ray_watch.stop()

    async def stop_replicas(self, drain_timeout_s: float) -> bool:
        """Drain and stop the router replicas (each finishes its own streams for up to
        ``drain_timeout_s``); True if all of them finished theirs. Nothing to do without."""
        if self.replicas is None:
            return True
        return await self.replicas.stop(drain_timeout_s)  # (again: SIGTERM twice stops them now)

    async def _stop_with_ray(self) -> None:
        await self.stop_replicas(0.0)
        if self.keeper is not None:
            await self.keeper.close()
        if self.frontends is not None:
            await self.frontends.stop()
        if self.router is not None:
            await self.router.stop()  # (closes the output channel too)
        elif self._outputs is not None:  # it did not get as far as a router
            await self._outputs.close()
        for h in self.handles:
            with contextlib.suppress(Exception):  # already dead: nothing to shut down
                await h.control(Shutdown(), timeout_s=10)
            if self.use_ray:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(h.caller.kill)
        if self._ray_watch is not None:
            self._ray_watch.stop()  # what goes from here on is stopped on purpose
        if self._owns_ray:
            from pdserve.deploy.ray_instance import shutdown_ray

            await asyncio.to_thread(shutdown_ray)
            self._owns_ray = False

    async def _stop_without_ray(self) -> None:
        """Ray's control plane is gone (``ray_lost``): whatever waits on it would wait out its
        timeout (a worker's start, an actor call, Ray's own shutdown), and the event loop's
        executor may be full of such calls. Each step here is bounded, nothing is asked of Ray,
        and the instance's processes, if this process started them, are stopped directly, on
        this thread."""
        steps = [
            self.stop_replicas(0.0),
            self.keeper.close() if self.keeper is not None else None,
            self.frontends.stop() if self.frontends is not None else None,
            self.router.stop()
            if self.router is not None
            else self._outputs.close()
            if self._outputs
            else None,
        ]
        for step in steps:
            if step is not None:
                with contextlib.suppress(Exception, asyncio.TimeoutError):
                    await asyncio.wait_for(step, LOST_STEP_S)
        if self._owns_ray:
            from pdserve.deploy.ray_instance import shutdown_ray

            shutdown_ray(gone=True)
            self._owns_ray = False


def _stop_abandoned(launch: asyncio.Future[list[WorkerHandle]]) -> None:
    """Stop the workers of a launch whose caller gave up (if it got as far as starting them)."""
    if launch.cancelled() or launch.exception() is not None:
        return
    for h in launch.result():
        threading.Thread(target=h.caller.kill, name=f"stop-{h.worker_id}", daemon=True).start()


class ServiceThread:
    """A ``Service`` on its own event loop thread (tests, benchmarks)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="pdserve-service", daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout_s: float = 600.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def start(self) -> Endpoints:
        result: Endpoints = self.run(self.service.start())
        return result

    def stop(self) -> None:
        try:
            self.run(self.service.stop(), timeout_s=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
