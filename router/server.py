"""Both front ends of one router in the current event loop, and the drain-on-signal loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import Generator

import uvicorn

from pdserve.router.chat import ChatTemplate
from pdserve.router.config import RouterConfig
from pdserve.router.grpc_api import GrpcServer
from pdserve.router.openai_api import build_http_app
from pdserve.router.service import Router
from pdserve.router.tls import TlsMaterial

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """Signals belong to ``serve_until_signal`` (it drains first), not to uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def chat_summary(router: Router, template: ChatTemplate) -> str:
    """What chat prompts are rendered with, for the start-up summary."""
    if router.tokenizer is None:
        return "unavailable (the model has no tokenizer: send token ids to /v1/completions)"
    if template.is_default:
        return "pdserve's built-in template (WARNING: the model ships none)"
    return f"template from {template.origin.origin}"


class Frontends:
    def __init__(self, router: Router, config: RouterConfig, tls: TlsMaterial | None = None) -> None:
        self.router = router
        self.config = config
        self.tls = tls
        self.chat_template = chat_template = ChatTemplate.of(router.tokenizer)
        if router.tokenizer is not None and chat_template.is_default:
            log.warning("the model ships no chat template: chat prompts use pdserve's built-in template")
        self.app = build_http_app(router, chat_template, config.api_key)
        self.grpc = GrpcServer(router, config.host, config.grpc_port, config.api_key, tls)
        https: dict[str, object] = {}
        if tls is not None:
            https = dict(
                ssl_certfile=tls.config.cert_file,
                ssl_keyfile=tls.config.key_file,
                ssl_ca_certs=tls.config.client_ca_file or None,
                ssl_cert_reqs=ssl.CERT_REQUIRED if tls.config.mutual else ssl.CERT_NONE,
            )
        self.http = _Uvicorn(
            uvicorn.Config(
                self.app,
                host=config.host,
                port=config.http_port,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=5,
                **https,  # type: ignore[arg-type]
            )
        )
        self._http_task: asyncio.Task[None] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def grpc_port(self) -> int:
        return self.grpc.port

    @property
    def http_port(self) -> int:
        return int(self.http.servers[0].sockets[0].getsockname()[1])

    async def start(self) -> None:
        await self.grpc.start()
        self._http_task = asyncio.create_task(self.http.serve())
        while not self.http.started:
            if self._http_task.done():
                await self._http_task
                raise OSError(f"the HTTP server did not start on {self.config.host}:{self.config.http_port}")
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float = 1.0) -> None:
        self.http.should_exit = True
        if self._http_task is not None:
            await asyncio.gather(self._http_task, return_exceptions=True)
        await self.grpc.stop(grace_s)


async def serve_until_signal(router: Router, frontends: Frontends, drain_timeout_s: float) -> bool:
    """Serve until SIGINT/SIGTERM, then drain: health turns NOT_SERVING, new requests get 503,
    in-flight ones get ``drain_timeout_s`` to finish. True if every request finished."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    print(f"draining {router.num_inflight} in-flight requests (up to {drain_timeout_s:g}s)...", flush=True)
    clean = await router.drain(drain_timeout_s)
    if not clean:
        log.warning("%d requests still running after the drain timeout; aborting them", router.num_inflight)
    await frontends.stop()
    await router.stop()
    return clean
