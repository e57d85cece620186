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
from typing import Any

from pdserve.deploy.pools import PoolSpec
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.outputs import OutputListener
from pdserve.router.server import Frontends, chat_template_for
from pdserve.router.service import Router
from pdserve.router.workers import WorkerHandle


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
        self.handles: list[WorkerHandle] = []
        self.router: Router | None = None
        self.frontends: Frontends | None = None
        self._placement: Any = None
        self._owns_ray = False

    async def start(self, progress: bool = False) -> Endpoints:
        secret = secrets.token_bytes(32)
        outputs = OutputListener(
            secret, host=self.config.worker_channel_host, liveness_timeout_s=self.config.liveness_timeout_s
        )
        address = await outputs.start()
        if self.use_ray:
            from pdserve.deploy.ray_pools import launch_ray, start_ray

            self._owns_ray = await asyncio.to_thread(
                start_ray, self.ray_address, self.spec.num_workers * self.spec.cpus_per_worker
            )
            self.handles, self._placement = await asyncio.to_thread(
                launch_ray, self.spec, 300.0, progress, secret, address
            )
        else:
            from pdserve.deploy.local import launch_local

            self.handles = await asyncio.to_thread(launch_local, self.spec, secret, address)
        model_dir = resolve_model(self.spec.engine.model)
        tokenizer = TextTokenizer.load(model_dir)
        self.router = Router(self.config, self.handles, tokenizer, outputs, colocated=self.spec.is_colocated)
        self.router.start()
        await outputs.wait_connected([h.worker_id for h in self.handles], timeout_s=60)
        self.frontends = Frontends(self.router, self.config, chat_template_for(model_dir, tokenizer))
        await self.frontends.start()
        return self.endpoints

    @property
    def endpoints(self) -> Endpoints:
        assert self.frontends is not None
        host = self.config.host
        return Endpoints(f"http://{host}:{self.frontends.http_port}", f"{host}:{self.frontends.grpc_port}")

    async def stop(self) -> None:
        if self.frontends is not None:
            await self.frontends.stop()
        if self.router is not None:
            await self.router.stop()
        for h in self.handles:
            with contextlib.suppress(Exception):  # already dead: nothing to shut down
                await h.call("shutdown", timeout_s=10)
            if self.use_ray:
                h.caller.kill()
        if self._placement is not None:
            from pdserve.deploy.ray_pools import release

            await asyncio.to_thread(release, self._placement, self._owns_ray)
            self._placement = None


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
