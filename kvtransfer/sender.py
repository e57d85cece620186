"""The sending (prefill) side: one connection, pusher thread and reader thread per peer.

``send`` only queues work, so the prefill worker never blocks on the network. The pusher
connects (lazily, once per peer) and sends ``begin`` without waiting for the answer, so the
set-up round trips of several transfers to one peer overlap each other's copies. The reader
thread takes the peer's answers (``ready``, ``reject``, ``abort``); a ``ready`` moves the
transfer to TRANSFERRING, and the layers computed by then are pushed by the reader itself on a
direct-write path (a copy and a small frame; on tcp the pusher sends the bulk bytes); the pusher
pushes each later layer as soon as it is computed (``layer_ready``); the frame that announces
the last of them also ends the transfer (where the receiver offers ``END_FLAG``; a ``done``
frame otherwise), so a whole direct-write transfer is ``begin``, ``ready`` and one ``layer``
frame. A ``begin`` unanswered within the I/O timeout fails the transfer (the reaper checks). A
transfer's lock is held while one of its layers is written, so an abort or a failure never races
a write: once a transfer is FAILED or DONE the transport no longer touches its source blocks
(and, for direct-write paths, the peer's).

Direct-write fence: a direct-write receiver's ``ready`` carries the end of its lease on the
host's monotonic clock (direct-write peers share a host, hence that clock). The sender starts no
write after it, so a receiver whose abort goes unconfirmed can still take its blocks back once
the lease plus a grace period has passed (see ``receiver``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.kvtransfer import wire
from pdserve.kvtransfer.channel import (
    Connection,
    ConnectionBroken,
    ConnectionLost,
    Peering,
    ThreadGroup,
    client_handshake,
)
from pdserve.kvtransfer.datapath import DataPath
from pdserve.kvtransfer.heads import HeadSlice, heads_of, transfer_problem
from pdserve.kvtransfer.states import (
    CompletionQueue,
    FailureCause,
    TransferError,
    TransferState,
    TransferStats,
    TransferTable,
)

log = logging.getLogger(__name__)

PEER_IDLE_S = 60.0  # a peer with nothing in flight this long loses its thread and connection
CONNECT_RETRY_S = 0.01  # the first wait before connecting again, doubling up to the next
MAX_CONNECT_RETRY_S = 0.5


def offered(conn: Connection) -> frozenset[str]:
    """The protocol features the receiver at the other end offered in its ``welcome``."""
    features = conn.info.get("features")
    return frozenset(f for f in features if isinstance(f, str)) if isinstance(features, list) else frozenset()


def rejected_because(cause: str) -> FailureCause:
    """A ``reject``'s cause as this side records it: a layout mismatch (head slices) as such,
    anything else as a refusal."""
    return (
        FailureCause.LAYOUT_MISMATCH if cause == FailureCause.LAYOUT_MISMATCH.value else FailureCause.REJECTED
    )


@dataclass(eq=False)
class Outgoing:
    transfer_id: str
    peer: str
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    layerwise: bool
    deadline: float
    heads: HeadSlice | None = None  # only these heads of each block move (None: whole blocks)
    state: TransferState = TransferState.BOOTSTRAPPING
    layers_ready: int = 0
    layers_sent: int = 0
    computed: object | None = None  # the path's marker taken when layers_ready last grew
    lock: threading.Lock = field(default_factory=threading.Lock)
    answer_by: float = 0.0  # when the begin went out, plus the I/O timeout (0: not out yet)
    write_until_ns: int | None = None  # direct-write fence from the receiver's ready
    conn: Connection | None = None  # the connection its begin went out on; all its bytes use it
    begun: bool = False  # its begin is on the wire: an abort now reaches a receiver that knows it
    cause: FailureCause | None = None  # why it FAILED
    started: float = field(default_factory=time.monotonic)
    nbytes: int = 0
    descriptors: int = 0  # copies made for a sliced transfer


class _Peer:
    def __init__(self, address: str) -> None:
        self.address = address
        self.conn: Connection | None = None  # set by the pusher; cleared under conn_lock
        self.conn_lock = threading.Lock()
        self.events: queue.Queue[tuple[str, Outgoing | None]] = queue.Queue()
        self.transfers: dict[str, Outgoing] = {}


class Sender(TransferTable[Outgoing]):
    def __init__(
        self,
        path: DataPath,
        backend: str,
        peering: Peering,
        completions: CompletionQueue,
        stats: TransferStats,
    ) -> None:
        self.path = path
        self.backend = backend
        self.peering = peering
        self.completions = completions
        self.stats = stats
        self.num_layers = path.num_layers
        self._lock: threading.Lock = threading.Lock()
        super().__init__(self._lock)
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self._threads = ThreadGroup()

    # -- owner API ---------------------------------------------------------------------------
    def send(
        self,
        transfer_id: str,
        peer: str,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        layerwise: bool,
        timeout_s: float,
        heads: HeadSlice | None = None,
    ) -> None:
        if len(src_blocks) != len(dst_blocks) or not src_blocks:
            raise ValueError("source and destination block lists must be non-empty and equally long")
        if heads is not None and heads.src_start + heads.count > self.path.num_heads:
            raise ValueError(f"head slice {heads} outside this cache's {self.path.num_heads} KV heads")
        t = Outgoing(
            transfer_id,
            peer,
            tuple(src_blocks),
            tuple(dst_blocks),
            layerwise,
            time.monotonic() + timeout_s,
            heads,
            layers_ready=0 if layerwise else self.num_layers,
            computed=None if layerwise else self.path.computed_marker(),
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("transport is closed")
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already known")
            self._transfers[transfer_id] = t
            p = self._peers.get(peer)
            if p is None:
                p = self._peers[peer] = _Peer(peer)
                self._threads.spawn(self._pusher, p, name=f"kv-push-{peer}")
            p.transfers[transfer_id] = t
        p.events.put(("begin", t))

    def layer_ready(self, transfer_id: str, layer: int) -> None:
        """Layers ``0..layer`` of the transfer's source blocks are computed and may be sent."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            p = self._peers.get(t.peer) if t else None
        if t is None or p is None:
            return
        marker = self.path.computed_marker()  # on the model's thread: what the copy waits for
        with self._lock:  # not t.lock: a push in progress must not stall the model's thread
            if layer < t.layers_ready:
                return
            t.layers_ready = min(layer + 1, self.num_layers)
            t.computed = marker
        p.events.put(("progress", t))

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            t = self._transfers.get(transfer_id)
            p = self._peers.get(t.peer) if t else None
        if t is not None and p is not None:
            self._fail(p, t, FailureCause.CANCELLED, notify_peer=True)

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            t = self._pop_terminal(transfer_id)
            p = self._peers.get(t.peer) if t else None
            if p is not None:
                p.transfers.pop(transfer_id, None)

    def reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [
                (self._peers[t.peer], t)
                for t in self._transfers.values()
                if not t.state.terminal
                and (now > t.deadline or (t.state is TransferState.BOOTSTRAPPING and 0 < t.answer_by < now))
            ]
        for p, t in expired:
            if t.state is TransferState.BOOTSTRAPPING and now <= t.deadline:
                log.info("kv transfer %s: no answer to begin from %s", t.transfer_id, p.address)
            self._fail(p, t, FailureCause.TIMEOUT, notify_peer=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
        for p in peers:
            p.events.put(("stop", None))
            for t in list(p.transfers.values()):
                self._fail(p, t, FailureCause.CANCELLED, notify_peer=False)
            with p.conn_lock:
                conn, p.conn = p.conn, None
            if conn is not None:
                conn.close()
        self._threads.join()

    # -- transitions -------------------------------------------------------------------------
    def _finish(self, t: Outgoing, state: TransferState, cause: FailureCause | None = None) -> bool:
        """Caller holds ``t.lock``. True if this call moved ``t`` to a terminal state."""
        if t.state.terminal:
            return False
        t.state = state
        if state is TransferState.DONE:
            self.stats.transfers_sent += 1
            backend = t.conn.backend if t.conn else "unknown"
            self.stats.sent_by_backend[backend] += t.nbytes
            if t.heads is not None:
                self.stats.descriptors_sent_by_backend[backend] += t.descriptors
            self.stats.send_seconds += time.monotonic() - t.started
            self.completions.sent(t.transfer_id)
        else:
            assert cause is not None
            t.cause = cause
            self.stats.failures[cause.value] += 1
            self.completions.failed(t.transfer_id, cause)
        return True

    def _fail(self, p: _Peer, t: Outgoing, cause: FailureCause, notify_peer: bool) -> None:
        with t.lock:  # waits for a layer write in progress to finish
            begun = t.begun  # else the pusher, sending the begin, follows it with the abort
            if not self._finish(t, TransferState.FAILED, cause):
                return
        conn = t.conn
        if notify_peer and begun and conn is not None and not conn.closed.is_set():
            with contextlib.suppress(TransferError):  # the reader notices a dead connection
                conn.send("abort", id=t.transfer_id, reason=cause.value)

    def _fail_peer(
        self, p: _Peer, conn: Connection, cause: FailureCause, current: Outgoing | None = None
    ) -> None:
        """``conn`` broke: fail what is in flight on it, close it, and forget it if still current."""
        with p.conn_lock:
            if p.conn is conn:
                p.conn = None
        for t in list(p.transfers.values()):
            if t.conn is conn or t is current:
                with t.lock:
                    self._finish(t, TransferState.FAILED, cause if t is current else FailureCause.PEER_LOST)
        self.path.detach(conn)
        conn.close()

    # -- threads -----------------------------------------------------------------------------
    def _connect(self, p: _Peer, t: Outgoing) -> Connection:
        """A set-up connection to ``p``. A refused or reset attempt (a receiver shedding
        connections that have not authenticated under a flood, one restarting) is made again,
        backing off, within ``connect_timeout_s``, unless ``t`` ended meanwhile; a refusal by
        the receiver itself (secret, layout, backend) is final."""
        deadline = time.monotonic() + self.peering.connect_timeout_s
        delay = CONNECT_RETRY_S
        while True:
            try:
                return self._connect_once(p)
            except TransferError as e:
                again = e.cause in (FailureCause.UNREACHABLE, FailureCause.PEER_LOST, FailureCause.TIMEOUT)
                if not again or time.monotonic() + delay > deadline or t.state.terminal:
                    raise
                log.debug("kv connection to %s: %s; again in %g s", p.address, e, delay)
                self.stats.connect_retries += 1
            time.sleep(delay)
            delay = min(2 * delay, MAX_CONNECT_RETRY_S)

    def _connect_once(self, p: _Peer) -> Connection:
        host, _, port = p.address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.peering.connect_timeout_s)
        except (OSError, ValueError) as e:
            raise TransferError(FailureCause.UNREACHABLE, f"cannot connect to {p.address}: {e}") from None
        try:
            conn = Connection(sock, self.peering.io_timeout_s, p.address)
        except OSError as e:
            sock.close()
            raise TransferError(FailureCause.UNREACHABLE, f"{p.address}: {e}") from None
        try:
            peering = self.peering
            client_handshake(
                conn, peering.secret, peering.layout, self.backend, self.path.hello_info(), peering.tls
            )
            self.path.attach(conn)
        except (TransferError, wire.FrameError):
            conn.close()
            raise
        except Exception as e:  # e.g. a peer mapping that cannot be opened
            conn.close()
            raise TransferError(FailureCause.UNREACHABLE, f"cannot attach to {p.address}: {e}") from None
        self._threads.spawn(self._reader, p, conn, name=f"kv-ans-{p.address}")
        return conn

    def _retire_if_idle(self, p: _Peer) -> bool:
        """Drop a peer with nothing in flight (its thread, connection and mapping go)."""
        with self._lock:
            if any(not t.state.terminal for t in p.transfers.values()) or not p.events.empty():
                return False
            if self._peers.get(p.address) is p:
                del self._peers[p.address]
        with p.conn_lock:
            conn, p.conn = p.conn, None
        if conn is not None:
            self.path.detach(conn)
            conn.close()
        return True

    def _pusher(self, p: _Peer) -> None:
        while True:
            try:
                kind, t = p.events.get(timeout=PEER_IDLE_S)
            except queue.Empty:
                if self._retire_if_idle(p):
                    return
                continue
            if kind == "stop":
                return
            assert t is not None
            if t.state.terminal:
                continue
            if kind == "begin":
                self._guarded(p, t, functools.partial(self._open_and_begin, p, t))  # ``ready`` comes back
            else:
                self._guarded(p, t, functools.partial(self._push_on_own_connection, t))

    def _guarded(self, p: _Peer, t: Outgoing, step: Callable[[], None]) -> None:
        """One step of sending ``t``, on the pusher or the reader thread: a step that fails
        fails ``t``, or everything on its connection when the stream itself broke."""
        try:
            if time.monotonic() > t.deadline:
                raise TransferError(FailureCause.TIMEOUT, "deadline passed before sending")
            step()
        except ConnectionBroken as e:  # the stream is unusable: everything on it fails
            log.info("kv connection to %s broke during %s: %s", p.address, t.transfer_id, e)
            if t.conn is not None:  # set once its begin found a connection
                self._fail_peer(p, t.conn, e.cause, current=t)
            else:
                self._fail(p, t, e.cause, notify_peer=False)
        except TransferError as e:  # this transfer only
            log.info("kv transfer %s to %s failed: %s", t.transfer_id, p.address, e)
            self._fail(p, t, e.cause, notify_peer=True)
        except Exception:  # a bug must fail the transfer, not kill the thread silently
            log.exception("kv transfer %s to %s crashed", t.transfer_id, p.address)
            self._fail(p, t, FailureCause.PROTOCOL, notify_peer=True)

    def _open_and_begin(self, p: _Peer, t: Outgoing) -> None:
        """Send ``begin`` on the peer's connection (made first if there is none); the reader
        hands the transfer back on ``ready``."""
        with p.conn_lock:
            conn = p.conn if p.conn is not None and not p.conn.closed.is_set() else None
        if conn is None:
            conn = self._connect(p, t)
            with p.conn_lock:
                p.conn = conn
        self._check_heads(conn, t.heads)
        with t.lock:
            if t.state.terminal:
                return  # cancelled while queued: no begin goes out
            t.conn = conn
            t.answer_by = time.monotonic() + self.peering.io_timeout_s
        # Outside the lock: a send may wait on a full socket, and a cancel must not wait with it.
        sliced: dict[str, Any] = {} if t.heads is None else {"heads": t.heads.to_wire()}
        conn.send(
            "begin",
            id=t.transfer_id,
            dst_blocks=list(t.dst_blocks),
            num_layers=self.num_layers,
            layerwise=t.layerwise,
            **sliced,
        )
        with t.lock:
            t.begun = True
            # failed here while the begin went out (no abort was sent: the receiver would have
            # ignored one ahead of the begin); a refusal or a lost connection needs none
            stopped = t.state is TransferState.FAILED and t.cause not in (
                FailureCause.REJECTED,
                FailureCause.PEER_LOST,
            )
        if stopped:
            assert t.cause is not None
            conn.send("abort", id=t.transfer_id, reason=t.cause.value)

    def _check_heads(self, conn: Connection, heads: HeadSlice | None) -> None:
        """Refuse, before its begin, a transfer the receiver's cache cannot take: a missing or
        out-of-range head slice (the receiver checks again), or one it cannot read."""
        layout = conn.info.get("layout")
        # A receiver that does not say predates head slices: it accepted us, so it has our heads.
        dst_heads = self.path.num_heads if layout is None else heads_of(layout)
        if dst_heads is None:
            raise TransferError(FailureCause.PROTOCOL, f"{conn.peer} sent a malformed layout")
        problem = transfer_problem(heads, self.path.num_heads, dst_heads)
        if problem is not None:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"{conn.peer}: {problem}")
        if heads is not None and wire.HEAD_SLICE not in offered(conn):
            raise TransferError(FailureCause.REJECTED, f"{conn.peer} does not take head slices")

    def _push_on_own_connection(self, t: Outgoing) -> None:
        """Push ``t``'s ready layers on the connection its begin found (none yet: nothing to do)."""
        if t.conn is not None:
            self._push_ready_layers(t.conn, t)

    def _push_ready_layers(self, conn: Connection, t: Outgoing) -> None:
        with self._lock:  # layer_ready sets both under this lock: read them as one pair
            ready, marker = t.layers_ready, t.computed
        with t.lock:
            if t.state is not TransferState.TRANSFERRING or t.layers_sent >= ready:
                return
            if conn.closed.is_set():
                raise ConnectionLost(f"connection to {conn.peer} is closed")
            if t.write_until_ns is not None and time.monotonic_ns() >= t.write_until_ns:
                raise TransferError(FailureCause.TIMEOUT, "the receiver's lease ended (write fence)")
            layers = range(t.layers_sent, ready)
            last = layers.stop == self.num_layers
            flag = wire.END_FLAG in offered(conn)
            if t.heads is None:
                t.nbytes += self.path.push_layers(
                    conn, t.transfer_id, layers, t.src_blocks, t.dst_blocks, after=marker, last=last and flag
                )
            else:
                moved = self.path.push_slice_layers(
                    conn, t.transfer_id, layers, t.src_blocks, t.dst_blocks, t.heads, marker, last and flag
                )
                t.nbytes += moved.nbytes
                t.descriptors += moved.descriptors
            t.layers_sent = layers.stop
            if last:
                if not flag:
                    conn.send("done", id=t.transfer_id)
                self._finish(t, TransferState.DONE)

    def _reader(self, p: _Peer, conn: Connection) -> None:
        try:
            while True:
                f = conn.read_frame(idle=True)
                with self._lock:
                    t = p.transfers.get(f.get("id", ""))
                if f["t"] not in ("ready", "reject", "abort"):
                    raise TransferError(FailureCause.PROTOCOL, f"unexpected {f['t']} frame from a receiver")
                if f["t"] == "abort":
                    # Stop writing it (if we still are), then confirm: the receiver frees its
                    # blocks on our word, so "aborted" goes out only after the lock is ours.
                    if t is not None:
                        with t.lock:
                            self._finish(t, TransferState.FAILED, FailureCause.CANCELLED)
                    conn.send("aborted", id=f["id"])
                    continue
                if t is None:
                    self.stats.ignored_frames += 1
                    continue
                with t.lock:
                    if t.state is not TransferState.BOOTSTRAPPING or t.conn is not conn:
                        self.stats.ignored_frames += 1
                        continue
                    if f["t"] == "reject":
                        log.info("kv transfer %s rejected by %s: %s", t.transfer_id, p.address, f["reason"])
                        self._finish(t, TransferState.FAILED, rejected_because(f["cause"]))
                        continue
                    t.write_until_ns = f.get("write_until_ns")
                    t.state = TransferState.TRANSFERRING
                if self.path.direct_write:
                    # Pushed from here: handing it back to the pusher would put a thread's wake-up
                    # on every hand-off's critical path. A direct-write push is a copy and one
                    # small frame, so the answers this thread reads wait no longer than that.
                    self._guarded(p, t, functools.partial(self._push_ready_layers, conn, t))
                else:  # bulk bytes on this socket: the pusher sends them
                    p.events.put(("progress", t))
        except (TransferError, wire.FrameError) as e:
            if not conn.closed.is_set():
                log.info("kv connection to %s ended: %s", p.address, e)
        finally:
            self._fail_peer(p, conn, FailureCause.PEER_LOST)
