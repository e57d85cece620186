"""Both front ends of one router in the current event loop, and the drain-on-signal loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import ssl
import tempfile
from collections.abc import Awaitable, Generator
from typing import Any, TypeVar

import uvicorn

from pdserve.router.chat import ChatTemplate
from pdserve.router.config import RouterConfig
from pdserve.router.grpc_api import GrpcServer
from pdserve.router.openai_api import build_http_app
from pdserve.router.service import Router
from pdserve.router.tls import TlsConfig, TlsMaterial, mutual_context
from pdserve.router.tls_front import TlsFront

log = logging.getLogger(__name__)
T = TypeVar("T")
BACKLOG = 2048  # uvicorn's default: connections waiting to be accepted


class _Uvicorn(uvicorn.Server):
    """Signals belong to ``serve_until_signal`` (it drains first), not to uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class _Https:
    """The HTTP app behind a ``TlsFront``: it is reached over a unix socket, but its clients
    speak https (the URLs it builds, such as redirects, say so)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "scheme": "https" if scope["type"] == "http" else "wss"}
        await self.app(scope, receive, send)


def chat_summary(router: Router, template: ChatTemplate) -> str:
    """What chat prompts are rendered with, for the start-up summary."""
    if router.tokenizer is None:
        return "unavailable (the model has no tokenizer: send token ids to /v1/completions)"
    if template.is_default:
        return "pdserve's built-in template (WARNING: the model ships none)"
    return f"template from {template.origin.origin}"


def listen_tcp(host: str, port: int, what: str, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (port 0: one the system picks);
    ``what`` names it in the error. IPv6 when ``host`` is an IPv6 address, else IPv4 (a name
    such as ``localhost`` binds its IPv4 address, as uvicorn binds it). ``reuse_port``: beside
    other router replicas' listeners (``reserve_tcp``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart past TIME_WAIT
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {what} to {host}:{port}: {e.strerror or e}") from None
    return sock


def reserve_tcp(host: str, port: int, what: str) -> socket.socket:
    """A TCP port held for router replicas: bound with ``SO_REUSEPORT`` and not listening, so
    it takes no connection itself while the replicas' servers bind the same port beside it
    (the kernel spreads connections over those that listen)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {what} to {host}:{port}: {e.strerror or e}") from None
    return sock


class Frontends:
    """The HTTP and gRPC front ends. Both ports are bound and listening from construction,
    before anything slow starts (Ray, the workers): a port taken fails the start at once, and
    nothing started meanwhile (Ray's own listeners, a worker's) can take it. Requests are served
    from ``start``; connections made before wait for it. ``stop`` lets the ports go, started
    or not.

    Until ``start`` the gRPC port is held by a plain socket, handed to the gRPC server there (a
    close and a bind, back to back; connections waiting on the plain socket are reset, and gRPC
    clients reconnect): a gRPC server made before Ray starts has threads running while Ray forks
    its processes, which gRPC's fork handlers then skip, and say so on stderr. Under mutual TLS
    both ports go to ``TlsFront``s instead (no gap), and the servers listen behind them.

    Router replicas (``pdserve.router.replica``) share both ports (``shared_ports``): each
    port is held by a bound, non-listening ``SO_REUSEPORT`` socket (it takes no connection,
    and no other user's process can take the port), and each replica's servers listen on it
    with ``SO_REUSEPORT`` too: the kernel spreads new connections evenly over the replicas
    that listen, and stops sending to one whose process ended. The pool owner holds the ports
    this way for the deployment's life and never starts its own servers.

    chat_template: the router's model's (set by ``start``)."""

    chat_template: ChatTemplate

    def __init__(
        self, config: RouterConfig, tls: TlsMaterial | None = None, shared_ports: bool = False
    ) -> None:
        self.config = config
        self.tls = tls
        self._shared = shared_ports
        hold = reserve_tcp if shared_ports else listen_tcp
        self._http_socket = hold(config.host, config.http_port, "HTTP")
        try:
            self._grpc_hold: socket.socket | None = hold(config.host, config.grpc_port, "gRPC")
        except BaseException:
            self._http_socket.close()
            raise
        self._grpc_port = int(self._grpc_hold.getsockname()[1])
        self._http_listener: socket.socket | None = None  # shared ports: this replica's own
        self._grpc_stopping: asyncio.Task[None] | None = None
        self.grpc: GrpcServer | None = None
        self.http: _Uvicorn | None = None
        self._fronts: list[TlsFront] = []  # mutual TLS only
        self._backends = ""  # their servers' unix sockets' directory
        self._http_task: asyncio.Task[None] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def grpc_port(self) -> int:
        return self._grpc_port

    @property
    def http_port(self) -> int:
        return int(self._http_socket.getsockname()[1])

    async def start(self, router: Router) -> None:
        chat_template = ChatTemplate.of(router.tokenizer)
        if router.tokenizer is not None and chat_template.is_default:
            log.warning("the model ships no chat template: chat prompts use pdserve's built-in template")
        self.chat_template = chat_template
        self.app = build_http_app(router, chat_template, self.config.api_key)
        https: dict[str, object] = {}
        tls = self.tls.config if self.tls is not None else None
        if tls is not None and not tls.mutual:
            https = dict(ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file, ssl_cert_reqs=ssl.CERT_NONE)
        self.http = _Uvicorn(
            uvicorn.Config(
                _Https(self.app) if tls is not None and tls.mutual else self.app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=5,
                backlog=BACKLOG,
                **https,  # type: ignore[arg-type]
            )
        )
        c = self.config
        if tls is not None and tls.mutual:
            http_sockets, grpc_address = self._front_ends(tls)
            self.grpc = GrpcServer(grpc_address, c.grpc_max_message_bytes, c.api_key)
        else:
            if self._shared:  # the holds stay, beside this replica's own listeners
                self._http_listener = listen_tcp(c.host, self.http_port, "HTTP", reuse_port=True)
                http_sockets = [self._http_listener]
            else:
                self._release_grpc_hold()
                http_sockets = [self._http_socket]
            address = f"{c.host}:{self._grpc_port}"
            self.grpc = GrpcServer(address, c.grpc_max_message_bytes, c.api_key, self.tls, self._shared)
        await self.grpc.start(router)
        self._http_task = asyncio.create_task(self.http.serve(sockets=http_sockets))
        while not self.http.started:
            if self._http_task.done():
                await self._http_task
                raise OSError(f"the HTTP server did not start on {self.config.host}:{self.http_port}")
            await asyncio.sleep(0.01)
        for front in self._fronts:
            await front.start()

    def _front_ends(self, tls: TlsConfig) -> tuple[list[socket.socket], str]:
        """Mutual TLS: the public ports go to ``TlsFront``s (they send the alert a refused client
        can report, and log why), the servers behind them listen on unix sockets in a directory
        of their own. (The HTTP server's sockets, the gRPC server's address.)"""
        self._backends = tempfile.mkdtemp(prefix="pdserve-front-")  # mode 0700: this user only
        http_path, grpc_path = os.path.join(self._backends, "http"), os.path.join(self._backends, "grpc")
        backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        backend.bind(http_path)
        backend.listen(BACKLOG)
        assert self._grpc_hold is not None
        self._fronts = [
            TlsFront("HTTP", mutual_context(tls, "http/1.1"), self._http_socket, http_path),
            TlsFront("gRPC", mutual_context(tls, "h2"), self._grpc_hold, grpc_path),
        ]
        self._grpc_hold = None  # the gRPC front serves it from now on
        return [backend], f"unix:{grpc_path}"

    def stop_accepting(self, grace_s: float) -> None:
        """A router replica that drains: new connections go to the other replicas (this one
        stops accepting on the shared HTTP socket, and its gRPC server refuses new calls, which
        sends its clients' channels to reconnect, and gives those running ``grace_s``)."""
        if self.http is not None:
            for server in self.http.servers:
                server.close()
        if self.grpc is not None and self._grpc_stopping is None:
            self._grpc_stopping = asyncio.ensure_future(self.grpc.stop(grace_s))

    async def stop(self, grace_s: float = 1.0) -> None:
        for front in self._fronts:
            await front.stop()
        if self.http is not None:
            self.http.should_exit = True
        if self._http_task is not None:
            await asyncio.gather(self._http_task, return_exceptions=True)
        self._http_socket.close()
        if self._http_listener is not None:
            self._http_listener.close()
        self._release_grpc_hold()
        if self.grpc is not None:
            await self.grpc.stop(grace_s)
        if self._grpc_stopping is not None:
            await asyncio.gather(self._grpc_stopping, return_exceptions=True)
        if self._backends:
            shutil.rmtree(self._backends, ignore_errors=True)

    def _release_grpc_hold(self) -> None:
        if self._grpc_hold is not None:
            self._grpc_hold.close()
            self._grpc_hold = None


class StopSignals:
    """SIGINT and SIGTERM for the whole life of a service, start-up and shutdown included.

    The first signal asks for a drain (``drain`` is set), the second for an immediate stop
    (``now``: in-flight requests are aborted); later ones are ignored while the shutdown runs.
    Handlers stay installed until ``close``, so a user's second Ctrl-C never raises
    ``KeyboardInterrupt`` in the middle of a shutdown (which would leave workers and Ray behind).
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.drain = asyncio.Event()
        self.now = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: signal.Signals) -> None:
        if not self.drain.is_set():
            self.drain.set()
        elif not self.now.is_set():
            print(f"pdserve: second stop signal ({sig.name}): stopping now, aborting what runs", flush=True)
            self.now.set()

    def stop_now(self, why: str) -> None:
        """Stop at once, as a second signal does, saying ``why`` (the workers cannot go on)."""
        print(f"pdserve: {why}: stopping now", flush=True)
        self.drain.set()
        self.now.set()

    def close(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.remove_signal_handler(sig)


async def first_of(work: Awaitable[T], stop: asyncio.Event) -> tuple[bool, T | None]:
    """Run ``work`` until it ends or ``stop`` is set (then it is cancelled): (finished, result)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False, None
    return True, task.result()


def settle_heap() -> None:
    """Keep what start-up allocated (Ray's driver, the frameworks, the tokenizer: a few hundred
    thousand objects that live as long as the process) out of every later garbage collection.
    Without it each full collection walks all of them — over a tenth of the router's CPU under
    a full load of streams; with it a collection walks only what serving allocated."""
    gc.collect()
    gc.freeze()


async def serve_until_signal(
    router: Router, frontends: Frontends, drain_timeout_s: float, signals: StopSignals
) -> bool:
    """Serve until SIGINT/SIGTERM, then drain: health turns NOT_SERVING, new requests get 503
    (a router replica stops accepting instead: its peers take them), in-flight ones get
    ``drain_timeout_s`` to finish (a second signal cuts that short). True if every request
    finished."""
    settle_heap()
    await signals.drain.wait()
    if router.attached:
        frontends.stop_accepting(drain_timeout_s)
    print(f"draining {router.num_inflight} in-flight requests (up to {drain_timeout_s:g}s)...", flush=True)
    finished, clean = await first_of(router.drain(drain_timeout_s), signals.now)
    if not (finished and clean):
        log.warning("%d requests still running; aborting them", router.num_inflight)
    await frontends.stop()
    await router.stop()
    return bool(finished and clean)
