"""The router replicas of a deployment (``pdserve serve --routers N``), as their pool owner
runs them: N processes (``pdserve.router.replica``) on this node, each a whole router.

The owner binds what must outlive a replica: each replica's worker channel socket (its
address goes into every worker's spec, so workers reconnect to a restarted replica where the
old one was; connections made while it restarts wait in the socket's backlog), kept open for
the deployment's life and handed to each replica process at its start, and the public ports
(held, not served: ``Frontends(shared_ports=True)``).

A replica that exits while the deployment runs (killed, crashed, or drained by its own
SIGTERM) is started again, with the pool as the owner knows it then; its streams ended with
it (the workers aborted them), the other replicas' never noticed. Per replica::

    STARTING --READY--> PREPARED --SERVE (all prepared)--> SERVING --exit--> BACKOFF
       ^                                                                       |
       +-----------------------------------------------------------------------+
    (back-off 0.2 s, doubling to 5 s, reset after 30 s up; stop(): SIGTERM, then SIGKILL)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.router.replica import READY, SERVE, SERVING, ReplicaSpec
from pdserve.router.server import listen_tcp

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # a replica's start: imports, tokenizer, the workers' channels
FIRST_BACKOFF_S = 0.2
MAX_BACKOFF_S = 5.0
STEADY_S = 30.0  # a replica up this long starts its next back-off from the first step again
KILL_AFTER_S = 5.0  # past the drain, a replica that has not exited is killed

SpecOf = Callable[[int], ReplicaSpec]  # replica index -> what it is told (the pool as of now)


@dataclass
class Replica:
    index: int
    channel: socket.socket  # its worker channel's listening socket
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    prepared: asyncio.Event = field(default_factory=asyncio.Event)  # ready to open its front ends
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # serving
    draining: asyncio.Event = field(default_factory=asyncio.Event)  # it said so: no new connections
    relay: asyncio.Task[None] | None = None  # reads its stdout
    opener: asyncio.Task[None] | None = None  # tells it to open its front ends

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.returncode is None else None


class ReplicaSet:
    def __init__(self, count: int, channel_host: str) -> None:
        if count < 2:
            raise ValueError("router replicas come two or more (one router runs in the serve process)")
        self.replicas = [Replica(i, listen_tcp(channel_host, 0, f"router replica {i}'s worker channel"))
                         for i in range(count)]  # fmt: skip
        self.channel_host = channel_host
        self._stopping = False
        self._go = asyncio.Event()  # every replica of the start was ready: they open their front ends
        self._spec_of: SpecOf | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def addresses(self) -> tuple[str, ...]:
        """Each replica's worker channel, ``host:port`` (what workers connect to)."""
        return tuple(f"{self.channel_host}:{r.channel.getsockname()[1]}" for r in self.replicas)

    def pids(self) -> list[int | None]:
        return [r.pid for r in self.replicas]

    async def start(self, spec_of: SpecOf, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start every replica and wait until each serves; raises ``RuntimeError`` naming the
        first that did not (its own output says why)."""
        self._spec_of = spec_of
        self._tasks = [asyncio.create_task(self._keep(r)) for r in self.replicas]
        deadline = asyncio.get_running_loop().time() + timeout_s
        for stage in ("prepared", "ready"):  # all ready, then all open their front ends together
            waits = [asyncio.create_task(getattr(r, stage).wait()) for r in self.replicas]
            _, pending = await asyncio.wait(
                waits, timeout=max(0.0, deadline - asyncio.get_running_loop().time())
            )
            for w in pending:
                w.cancel()
            if pending:
                late = [r.index for r in self.replicas if not getattr(r, stage).is_set()]
                raise RuntimeError(f"router replica(s) {late} did not start within {timeout_s:g} s")
            self._go.set()

    async def _keep(self, r: Replica) -> None:
        backoff = FIRST_BACKOFF_S
        while not self._stopping:
            try:
                await self._spawn(r)
                assert r.process is not None
                code = await r.process.wait()
            except Exception as e:  # could not even start it: try again, as after an exit
                log.error("router replica %d did not start: %s", r.index, e)
                code = None
            if self._stopping:
                return
            up_s = time.monotonic() - r.started_at
            backoff = FIRST_BACKOFF_S if up_s >= STEADY_S else backoff
            r.restarts += 1
            log.error("router replica %d exited (code %s) after %.1f s; starting it again in %g s",
                      r.index, code, up_s, backoff)  # fmt: skip
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    async def _spawn(self, r: Replica) -> None:
        assert self._spec_of is not None
        spec = self._spec_of(r.index)
        fds = (spec.channel_fd,)
        r.prepared.clear()
        r.ready.clear()
        r.draining.clear()
        r.started_at = time.monotonic()
        proc = r.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdserve.router.replica",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, pass_fds=fds,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(pickle.dumps(spec))
        await proc.stdin.drain()
        r.relay = asyncio.create_task(self._relay(r, proc.stdout))
        r.opener = asyncio.create_task(self._open_when_told(r, proc))

    async def _open_when_told(self, r: Replica, proc: asyncio.subprocess.Process) -> None:
        """Once it is ready and the set may serve (at start, when every replica is ready; a
        restart at once), tell the replica to open its front ends."""
        await r.prepared.wait()
        await self._go.wait()
        assert proc.stdin is not None
        with contextlib.suppress(OSError, RuntimeError):  # (it exited meanwhile)
            proc.stdin.write(SERVE)
            await proc.stdin.drain()
            proc.stdin.close()

    async def _relay(self, r: Replica, out: asyncio.StreamReader) -> None:
        """Its stdout: ``READY`` marks it serving; anything else is shown as its own."""
        async for raw in out:
            line = raw.decode(errors="replace").rstrip()
            if line.startswith("draining"):
                r.draining.set()
            if line == READY:
                r.prepared.set()
            elif line == SERVING:
                r.ready.set()
                log.info("router replica %d serving (pid %s)", r.index, r.pid)
            elif line:
                print(f"[router {r.index}] {line}", flush=True)

    async def stop(self, drain_timeout_s: float) -> bool:
        """SIGTERM every replica (each drains its own requests for up to ``drain_timeout_s``),
        SIGKILL what is left after that; then close the sockets. True if all exited cleanly."""
        self._stopping = True
        procs = [r.process for r in self.replicas if r.process is not None and r.process.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)  # (one still waiting to open its front ends stops)
            if p.stdin is not None:
                p.stdin.close()
        clean = True
        for p in procs:
            try:
                clean = await asyncio.wait_for(p.wait(), drain_timeout_s + KILL_AFTER_S) == 0 and clean
            except asyncio.TimeoutError:
                clean = False
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in self.replicas:
            r.channel.close()
        return clean

    def kill(self, index: int, sig: signal.Signals = signal.SIGKILL) -> int:
        """Send replica ``index`` ``sig`` (chaos, tests; SIGTERM drains it): its pid. The set
        starts it again once it exits."""
        pid = self.replicas[index].pid
        if pid is None:
            raise ValueError(f"router replica {index} is not running")
        os.kill(pid, sig)
        return pid
