"""One deployment end to end: worker pools (Ray or in-process) + router + HTTP/gRPC front ends.

``Service`` is what ``pdserve serve`` runs; ``ServiceThread`` runs the same thing on a
background event loop so tests and benchmarks can drive it from synchronous code.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.deploy.keeper import PoolKeeper
from pdserve.deploy.pools import PoolSpec
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.outputs import OutputListener
from pdserve.router.server import Frontends, chat_template_for
from pdserve.router.service import Router
from pdserve.router.workers import WorkerHandle
from pdserve.worker.host import WorkerSpec
from pdserve.worker.messages import WorkerRole

if TYPE_CHECKING:
    from pdserve.deploy.ray_pools import Placement


@dataclass(frozen=True)
class Endpoints:
    http: str  # base URL, e.g. http://127.0.0.1:8000
    grpc: str  # host:port


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
        self._channel_address = ""
        self._placement: Placement | None = None
        self._owns_ray = False

    async def start(self, progress: bool = False) -> Endpoints:
        outputs = OutputListener(
            self._secret,
            host=self.config.worker_channel_host,
            liveness_timeout_s=self.config.liveness_timeout_s,
        )
        self._channel_address = await outputs.start()
        if self.use_ray:
            from pdserve.deploy.ray_pools import Placement, start_ray

            self._owns_ray = await asyncio.to_thread(
                start_ray, self.ray_address, self.spec.num_workers * self.spec.cpus_per_worker
            )
            self._placement = Placement.of(self.spec)
        specs = self.spec.worker_specs(self._secret, self._channel_address, own_process=self.use_ray)
        self.handles = await asyncio.to_thread(self._launch, specs, progress)
        model_dir = resolve_model(self.spec.engine.model)
        tokenizer = TextTokenizer.load(model_dir)
        self.router = Router(self.config, self.handles, tokenizer, outputs, colocated=self.spec.is_colocated)
        self.router.start()
        if self.spec.replace_lost:
            first = {role: n for role, n in self.spec.roles}
            self.keeper = PoolKeeper(self.router, outputs, self._launch_one, first, self._joined)
        await outputs.wait_connected([h.worker_id for h in self.handles], timeout_s=60)
        self.frontends = Frontends(self.router, self.config, chat_template_for(model_dir, tokenizer))
        await self.frontends.start()
        return self.endpoints

    def _launch(self, specs: list[WorkerSpec], progress: bool) -> list[WorkerHandle]:
        if self._placement is not None:
            from pdserve.deploy.ray_pools import launch_workers

            return launch_workers(specs, self._placement, 300.0, progress)
        from pdserve.deploy.local import launch_local

        return launch_local(specs)

    async def _launch_one(self, role: WorkerRole, worker_id: str) -> WorkerHandle:
        ws = self.spec.worker_spec(role, worker_id, self._secret, self._channel_address, self.use_ray)
        [handle] = await asyncio.to_thread(self._launch, [ws], False)
        return handle

    def _joined(self, worker: WorkerHandle) -> None:
        # Lost workers were stopped when the router let them go; their replacements take their place.
        self.handles = [h for h in self.handles if h.alive] + [worker]

    @property
    def endpoints(self) -> Endpoints:
        assert self.frontends is not None
        host = self.config.host
        return Endpoints(f"http://{host}:{self.frontends.http_port}", f"{host}:{self.frontends.grpc_port}")

    async def stop(self) -> None:
        if self.keeper is not None:
            await self.keeper.close()
        if self.frontends is not None:
            await self.frontends.stop()
        if self.router is not None:
            await self.router.stop()
        for h in self.handles:
            with contextlib.suppress(Exception):  # already dead: nothing to shut down
                await h.call("shutdown", timeout_s=10)
            if self.use_ray:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(h.caller.kill)
        if self._owns_ray:
            from pdserve.deploy.ray_pools import shutdown_ray

            await asyncio.to_thread(shutdown_ray)
            self._owns_ray = False


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
