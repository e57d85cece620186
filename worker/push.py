"""Worker side of the worker channel: one connection to each router of the deployment, carrying
this worker's output batches and, the other way, the routers' commands and their answers.

Why not Ray calls: a round trip through Ray costs about a millisecond on a busy host, paid on
every request's first token and decode step; a socket write costs tens of microseconds, and
the connection's end-of-file tells the router at once that this process died. Commands on one
connection also arrive in the order that router sent them, so an abort never overtakes the
command that added its request.

Routers: ``addresses[0]`` is the pool owner's (the one router of a single-router deployment);
the others are router replicas (``pdserve serve --routers N``), which any client request may
reach. Each request belongs to the router whose command brought it here (``Owners``): its
deltas go to that router alone; every router gets the worker's load with each frame, with the
work the other routers placed here as ``others`` — so each replica decides on the whole
worker's state without talking to the others.

Losing a router: the owner's connection ending ends the channel (as with one router: the
owner stops or replaces this worker). A replica's ending aborts every request it owned here at
once (its clients are gone; their blocks are freed) and the worker connects to that address
again, for as long as it runs: a restarted replica finds every worker within a back-off step.
A replica's connection whose writes block for ``SEND_TIMEOUT_S`` (a stopped process) is cut
the same way, so one wedged replica never stalls the others' streams for long.

Threads: the pusher (collects the engine's deltas, writes every frame), one keeper per replica
address (connects, waits for the end, cleans up), and each connection's reader and answer
sender (``pdserve.worker.link``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

from pdserve.kvtransfer.tls import InternalTls
from pdserve.worker.codec import encode_batch
from pdserve.worker.commands import Abort, Answer, Command, CommandError, Start, Withdraw
from pdserve.worker.info_codec import encode_info
from pdserve.worker.link import Link, connect_retrying, error_of
from pdserve.worker.loop import EngineLoop, WorkerFailed
from pdserve.worker.messages import OutputBatch, TokenDelta, WorkerInfo, WorkerLoad
from pdserve.worker.owners import Introducing, Owners

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # an idle worker still reports its load this often
CONNECT_TIMEOUT_S = 30.0  # the owner's first connection (a replica's is tried for good)
LOAD_EVERY_S = 0.02  # a router with no deltas in a batch still gets the load this often
SEND_TIMEOUT_S = 2.0  # a replica's connection that cannot take a frame this long is cut
RECONNECT_MAX_DELAY_S = 0.5  # the back-off's cap while a replica's address refuses

Execute = Callable[[Command], "Future[Answer]"]


class OutputPusher:
    def __init__(
        self,
        loop: EngineLoop,
        load: Callable[[], WorkerLoad],
        info: Callable[[], WorkerInfo],
        worker_id: str,
        addresses: Sequence[str],
        secret: bytes,
        execute: Execute,
        tls: InternalTls | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("a worker channel needs at least one router address")
        self.loop = loop
        self.load = load
        self.info = info
        self.worker_id = worker_id
        self.addresses = tuple(addresses)
        self.secret = secret
        self.execute = execute
        self.tls = tls
        self.error: BaseException | None = None
        self.aborted_for_lost_routers = 0  # requests aborted because their router went away
        self._stop = threading.Event()
        self._links: list[Link | None] = [None] * len(self.addresses)
        self._owners = Owners()
        self._tracking = len(self.addresses) > 1  # one router owns every request: no book kept
        self._lock = threading.Lock()  # the owners' book: readers (commands) and the pusher (deltas)
        self._sent_info: WorkerInfo | None = None
        self._thread = threading.Thread(target=self._run, name="output-push", daemon=True)
        self._thread.start()

    @property
    def bad_commands(self) -> int:
        return sum(link.bad_commands for link in self._links if link is not None)

    def owned(self) -> int:
        """Requests whose router is known here (per-request state: empty when idle)."""
        with self._lock:
            return len(self._owners)

    def owned_by(self) -> list[int]:
        """Requests each router owns here (index 0: the pool owner's)."""
        with self._lock:
            return [len(self._owners.owned_by(i)) for i in range(len(self.addresses))]

    # -- connections ---------------------------------------------------------------------------
    def _open(self, index: int, deadline: float) -> Link:
        replica = index > 0
        sock = connect_retrying(
            self.addresses[index], self.worker_id, self.secret, self.tls, deadline, self._stop,
            send_timeout_s=SEND_TIMEOUT_S if replica else 0.0,
            max_delay_s=RECONNECT_MAX_DELAY_S if replica else 1.0,
        )  # fmt: skip
        link = Link(index, self.addresses[index], sock, self._on_command)
        try:
            link.send(encode_info(self.info()))
        except OSError:
            link.close()
            raise
        return link

    def _keep(self, index: int) -> None:
        """A replica's connection, for as long as the worker runs: connect, serve, and when it
        ends abort what that replica owned here, then connect again."""
        while not self._stop.is_set():
            try:
                link = self._open(index, math.inf)
            except OSError as e:
                if self._stop.is_set():
                    return
                log.warning("worker channel to router %s refused for good: %s", self.addresses[index], e)
                return
            self._links[index] = link
            log.info("worker channel to router replica %s up", link.address)
            link.closed.wait()
            self._links[index] = None
            if self._stop.is_set():
                return
            self._abort_owned(index, link.address)

    def _abort_owned(self, index: int, address: str) -> None:
        with self._lock:
            orphans = self._owners.owned_by(index)
            for rid in orphans:
                self._owners.forget(rid)
        for rid in orphans:
            try:
                self.execute(Abort(rid))
            except Exception as e:  # the loop stopped: nothing left to free
                log.debug("abort of %s after losing router %s: %s", rid, address, e)
        self.aborted_for_lost_routers += len(orphans)
        level = logging.WARNING if orphans else logging.INFO  # (a replica drained or stopped on purpose)
        log.log(
            level, "router %s lost: aborted its %d request(s) here; connecting again", address, len(orphans)
        )

    def _on_command(self, link: Link, cmd: Command) -> Future[Answer] | CommandError:
        if self._tracking:
            with self._lock:
                if isinstance(cmd, Introducing):  # before it runs: its first deltas know their router
                    self._owners.introduce(link.index, cmd)
                elif isinstance(cmd, Abort):
                    self._owners.command(cmd)
        try:
            fut = self.execute(cmd)
        except BaseException as e:  # refused before it was queued (loop stopped, wrong role)
            if self._tracking and isinstance(cmd, Introducing):
                with self._lock:
                    self._owners.forget(cmd.work.request_id)
            return error_of(e)
        if self._tracking and isinstance(cmd, Introducing | Start | Withdraw):
            fut.add_done_callback(functools.partial(self._answered, cmd))
        return fut

    def _answered(self, cmd: Command, fut: Future[Answer]) -> None:
        try:
            answer = fut.result()
        except BaseException:  # refused: a request it would have added never came to be
            if isinstance(cmd, Introducing):
                with self._lock:
                    self._owners.forget(cmd.work.request_id)
            return
        if not isinstance(cmd, Introducing):
            with self._lock:
                self._owners.command(cmd, answer)

    # -- output ------------------------------------------------------------------------------
    def _run(self) -> None:
        owner: Link | None = None
        try:
            owner = self._links[0] = self._open(0, time.monotonic() + CONNECT_TIMEOUT_S)
            for i in range(1, len(self.addresses)):
                threading.Thread(target=self._keep, args=(i,), name=f"router-link-{i}", daemon=True).start()
            deltas: list[TokenDelta] = []
            while not self._stop.is_set() and not owner.closed.is_set():
                try:
                    deltas = self.loop.collect(HEARTBEAT_S)
                except WorkerFailed:
                    return  # the loop died: closing the sockets tells the routers
                self._push(deltas, heartbeat=not deltas)
            # Stopping: what the engine produced since the last batch still goes out — a drained
            # worker's last deltas end the requests the drain waited for, and a router that
            # never got them would move those requests as if the worker had died under them.
            with contextlib.suppress(WorkerFailed):
                if not owner.closed.is_set() and (deltas := self.loop.collect(0.0)):
                    self._push(deltas, heartbeat=False)
            if owner.closed.is_set() and not self._stop.is_set():
                raise ConnectionError("the owner's connection ended")
        except BaseException as e:
            if not self._stop.is_set():
                self.error = e
                if owner is not None and owner.router_closed:  # the router went first
                    log.info("the router closed the worker channel")
                else:
                    log.error("worker channel to %s failed: %s", self.addresses[0], e)
        finally:
            for link in self._links:
                if link is not None:
                    link.close()

    def _push(self, deltas: list[TokenDelta], heartbeat: bool) -> None:
        """One collect's deltas, each to its request's router; the load to every router that
        gets deltas, is due a heartbeat, or has not heard from here for ``LOAD_EVERY_S``."""
        links = list(self._links)  # (a replica may connect meanwhile: this call sees it next time)
        info = self.info()
        if info is not self._sent_info:  # (a role switch): every router learns it first
            self._sent_info = info
            self._broadcast(encode_info(info), links)
        load = self.load()
        # The prefix cache's changes ride along, to every router (each routes by them); a
        # connection's first batch replaces that router's view with a snapshot, taken after
        # this take (so it holds those ops) and sent instead of them.
        kv = self.loop.take_kv_events()
        if len(links) == 1:  # one router: every collect is one frame, as it always was
            link = links[0]
            if link is not None and link.fresh:
                kv, link.fresh = self.loop.kv_snapshot(), False
            self._send(link, encode_batch(self.worker_id, OutputBatch(tuple(deltas), load, kv)))
            return
        per: dict[int, list[TokenDelta]] = {}
        with self._lock:
            for d in deltas:
                owner = self._owners.on_delta(d)
                if owner is None and d.kv_lost:
                    # A prefill worker forgets whose prompt it handed off (its KV is gone from
                    # here); a push that fails later is news to whichever router owns it, and
                    # every other router ignores an id it does not hold.
                    for i in range(len(links)):
                        per.setdefault(i, []).append(d)
                    continue
                per.setdefault(owner or 0, []).append(d)
            others = {i: self._owners.others(i) for i in range(len(links)) if links[i] is not None}
        now = time.monotonic()
        for i, link in enumerate(links):
            if link is None or link.closed.is_set():
                continue
            mine = per.get(i)
            events = kv
            if link.fresh:
                events, link.fresh = self.loop.kv_snapshot(), False
            if mine or events is not None or heartbeat or now - link.last_sent >= LOAD_EVERY_S:
                batch = OutputBatch(tuple(mine or ()), replace(load, others=others[i]), events)
                self._send(link, encode_batch(self.worker_id, batch))

    def _broadcast(self, data: bytes, links: Sequence[Link | None]) -> None:
        for link in links:
            if link is not None and not link.closed.is_set():
                self._send(link, data)

    def _send(self, link: Link | None, data: bytes) -> None:
        if link is None:
            return
        try:
            link.send(data)
        except OSError:
            if link.index == 0:
                raise  # the owner's channel is the worker's lifeline
            log.warning("worker channel to router %s: a write failed; cutting it", link.address)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S + 1)
