"""A router replica's process: one of N routers in front of one worker pool
(``pdserve serve --routers N``; its pool owner starts it: ``pdserve.deploy.replicas``).

A replica is a whole router (admission, the goodput policy, request flow, migration, both
front ends) that owns no worker process. It serves the deployment's public ports beside its
peers (the HTTP socket the owner bound, which every replica accepts on; the gRPC port with
``SO_REUSEPORT``), and its worker channel on a listening socket the owner keeps for it, so that
after a restart the workers find it where they left it. The owner tells it the pool as it is
when it starts; later workers join when their channels open (their first frame says what
they are: ``Membership.attach``). What it knows of the other replicas' work comes from the
workers alone (``WorkerLoad.others``): replicas never talk to each other.

The spec comes once, pickled, on stdin: an anonymous pipe its parent created and holds alone
(the parent also chose this process's code, so nothing crosses a trust boundary; nothing read
from a network is ever unpickled). It writes ``READY`` on stdout once it could serve, opens its
front ends when the owner writes ``SERVE`` on its stdin, and says ``SERVING`` when they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import sys
import threading
from dataclasses import dataclass

from pdserve.kvtransfer.tls import InternalTls
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.constraint_check import ConstraintChecker
from pdserve.router.outputs import OutputListener
from pdserve.router.server import Frontends, StopSignals, first_of, serve_until_signal
from pdserve.router.service import Router
from pdserve.router.tls import load_tls
from pdserve.router.workers import attached
from pdserve.worker.messages import WorkerInfo

READY = "READY"  # stdout: ready to serve (the owner then writes ``SERVE`` on its stdin)
SERVE = b"SERVE\n"
SERVING = "SERVING"  # stdout: its front ends are open
CONNECT_WAIT_S = 10.0  # the pool's workers' channels, before the replica serves anyway

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSpec:
    """What one router replica is told to be."""

    index: int
    config: RouterConfig  # the deployment's, with the shared ports resolved and ``router_id`` set
    model: str  # the model (a path or a preset name): its tokenizer and generation defaults
    colocated: bool
    secret: bytes  # the cluster secret: workers prove it on the channel, and so does the replica
    internal_tls: InternalTls | None
    workers: tuple[WorkerInfo, ...]  # the pool when it starts (later workers join by themselves)
    channel_fd: int  # its worker channel's listening socket (inherited)


async def serve_replica(spec: ReplicaSpec) -> bool:
    """Serve until SIGTERM/SIGINT (drain: its peers take new connections), then stop; True if
    every request it held finished."""
    checkpoint = resolve_model(spec.model)
    tokenizer = await asyncio.to_thread(TextTokenizer.load, checkpoint)
    generation = checkpoint.generation_config().defaults
    config = spec.config
    channel = socket.socket(fileno=spec.channel_fd)
    outputs = OutputListener(
        spec.secret, liveness_timeout_s=config.liveness_timeout_s, tls=spec.internal_tls, sock=channel
    )
    await outputs.start()
    handles = [attached(info) for info in spec.workers]
    checker = ConstraintChecker(spec.model) if tokenizer is not None else None
    router = Router(
        config, handles, tokenizer, outputs, spec.colocated, generation, attached=True, constraints=checker
    )
    router.start()
    try:
        await outputs.wait_connected([h.worker_id for h in handles], timeout_s=CONNECT_WAIT_S)
    except asyncio.TimeoutError:
        missing = [h.worker_id for h in handles if h.channel is None]
        log.warning("serving before these workers connected: %s", ", ".join(missing))
    tls = load_tls(config.tls) if config.tls is not None else None
    frontends = Frontends(config, tls, shared_ports=True)
    signals = StopSignals()
    try:
        # Ready, but the front ends open only when the owner says so: once every replica of a
        # starting deployment is ready, so that nothing answers before ``pdserve serve`` does.
        print(READY, flush=True)
        read, line = await first_of(_stdin_line(), signals.drain)
        if not read or line != SERVE:  # stopped first, or the owner went away
            await frontends.stop()
            await router.stop()
            return True
        await frontends.start(router)
        print(SERVING, flush=True)
        return await serve_until_signal(router, frontends, config.drain_timeout_s, signals)
    finally:
        signals.close()


def _stdin_line() -> asyncio.Future[bytes]:
    """The next line on stdin, read on a daemon thread (a stop must not wait for the owner)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bytes] = loop.create_future()

    def settle(line: bytes) -> None:
        if not fut.done():
            fut.set_result(line)

    def read() -> None:
        line = sys.stdin.buffer.readline()
        with contextlib.suppress(RuntimeError):  # (the loop closed first)
            loop.call_soon_threadsafe(settle, line)

    threading.Thread(target=read, name="owner-says", daemon=True).start()
    return fut


def main() -> int:
    # Run as ``-m``, this module is ``__main__``: the spec's class is the importable module's.
    from pdserve.router.replica import ReplicaSpec as Spec
    from pdserve.router.replica import serve_replica as serve

    spec = pickle.load(sys.stdin.buffer)  # the parent's pipe (see the module's docstring)
    if not isinstance(spec, Spec):
        print("pdserve router replica: bad spec on stdin", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.WARNING, format=f"[router {spec.config.router_id}] %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    clean = asyncio.run(serve(spec))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
