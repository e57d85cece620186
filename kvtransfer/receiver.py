"""The receiving (decode) side: reserved destinations, a listener, one reader per connection.

The owner (the decode worker) reserves blocks, then calls ``expect(id, blocks, lease)``. A
sender connects, authenticates, and sends ``begin`` naming exactly those blocks; the receiver
answers ``ready`` (or ``reject``) and then takes ``data`` (tcp) or ``layer`` (direct-write)
frames, the last of which says ``done`` (a separate ``done`` frame is accepted too). What this
side takes beyond the first protocol (``features``: ``END_FLAG``) is offered in its ``welcome``,
and a sender uses only that, so either side may be upgraded first. A transfer is DONE only when
every layer arrived in full. Any doubt fails it: a missing layer at ``done``, a lost connection,
an expired lease, a cancel. For direct-write paths an accepted transfer is failed only once no
write can reach its blocks any more: the sender confirmed it stopped (``aborted``), its
connection is gone, or the write fence passed. The fence: ``ready`` tells a direct-write sender
when the lease ends on the host's monotonic clock, and the sender starts no write after that; a
sender that never confirms an abort loses the blocks at lease end + ``fence_grace_s`` (which
bounds one write already under way) and its connection is closed, as it no longer follows the
protocol.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.kvtransfer import wire
from pdserve.kvtransfer.admission import PendingConnections
from pdserve.kvtransfer.channel import Connection, Peering, ThreadGroup, server_handshake
from pdserve.kvtransfer.datapath import DataPath
from pdserve.kvtransfer.heads import HeadSlice, heads_of, transfer_problem
from pdserve.kvtransfer.slices import slice_block_nbytes
from pdserve.kvtransfer.states import (
    CompletionQueue,
    FailureCause,
    TransferError,
    TransferState,
    TransferStats,
    TransferTable,
)

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # authenticated senders per receiver; more are closed once they authenticate
FENCE_GRACE_S = 2.0
LISTEN_BACKLOG = 1024  # the kernel caps it at net.core.somaxconn


# What this receiver understands beyond the first protocol, offered in its ``welcome``: a sender
# uses only what its peer offers, so either side can be upgraded first.
FEATURES = (wire.END_FLAG, wire.HEAD_SLICE)


@dataclass
class Incoming:
    transfer_id: str
    dst_blocks: tuple[int, ...]
    num_layers: int
    deadline: float
    heads: HeadSlice | None = None  # the receiver's heads it fills (None: whole blocks)
    state: TransferState = TransferState.BOOTSTRAPPING
    conn: Connection | None = None
    direct_write: bool = False
    layers: set[int] = field(default_factory=set)
    received: dict[int, int] = field(default_factory=dict)  # layer -> blocks received (tcp)
    started: float = 0.0
    nbytes: int = 0
    descriptors: int = 0  # copies this side made for it (a sliced transfer's scatter)
    stopping: FailureCause | None = None  # to fail once no writer can touch the blocks any more
    receiving: bool = False  # this receiver's reader is writing into the blocks right now


class Receiver(TransferTable[Incoming]):
    def __init__(
        self,
        paths: dict[str, DataPath],
        peering: Peering,
        completions: CompletionQueue,
        stats: TransferStats,
        fence_grace_s: float = FENCE_GRACE_S,
    ) -> None:
        self.fence_grace_s = fence_grace_s
        self.paths = paths
        self.peering = peering
        self.completions = completions
        self.stats = stats
        self.num_layers = next(iter(paths.values())).num_layers
        self.num_blocks = next(iter(paths.values())).cache.shape[1]
        self.num_heads = next(iter(paths.values())).num_heads
        self._lock: threading.Condition = threading.Condition()
        super().__init__(self._lock)
        self._conns: set[Connection] = set()  # every open one, authenticated or not
        self._pending: PendingConnections[Connection] = PendingConnections()  # not authenticated yet
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self.address = ""
        self._threads = ThreadGroup()

    # -- owner API ---------------------------------------------------------------------------
    def listen(self, host: str, port: int) -> str:
        if self._listener is not None:
            return self.address
        # A deep accept queue: a burst of connections (a flood among them) must not drop a real
        # sender's SYN before the accept loop has shed what has not authenticated.
        sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        self._listener = sock
        h, p = sock.getsockname()[:2]
        self.address = f"{h}:{p}"
        self._threads.spawn(self._accept_loop, name=f"kv-accept-{p}")
        return self.address

    def expect(
        self, transfer_id: str, dst_blocks: Sequence[int], lease_s: float, heads: HeadSlice | None = None
    ) -> None:
        if not dst_blocks:
            raise ValueError("a transfer needs at least one destination block")
        if any(not 0 <= b < self.num_blocks for b in dst_blocks):
            raise ValueError(f"destination blocks outside 0..{self.num_blocks - 1}")
        if heads is not None and heads.dst_start + heads.count > self.num_heads:
            raise ValueError(f"head slice {heads} outside this cache's {self.num_heads} KV heads")
        with self._lock:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already known")
            self._transfers[transfer_id] = Incoming(
                transfer_id, tuple(dst_blocks), self.num_layers, time.monotonic() + lease_s, heads
            )

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is not None:
                self._stop(t, FailureCause.CANCELLED)

    def layers_done(self, transfer_id: str) -> int:
        """How many leading layers are complete (decode may start on layer i once i < this)."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                return 0
            n = 0
            while n in t.layers:
                n += 1
            return n

    def wait(self, transfer_id: str, timeout_s: float, layers: int | None = None) -> TransferState | None:
        """Block until the transfer is terminal (or ``layers`` leading layers are in)."""
        deadline = time.monotonic() + timeout_s

        def ready() -> bool:
            t = self._transfers.get(transfer_id)
            if t is None or t.state.terminal:
                return True
            return layers is not None and all(i in t.layers for i in range(layers))

        with self._lock:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, 0.05))
                self._reap_locked(time.monotonic())
            t = self._transfers.get(transfer_id)
            return t.state if t else None

    def forget(self, transfer_id: str) -> None:
        """Drop a terminal transfer's record (its completion was already reported)."""
        with self._lock:
            self._pop_terminal(transfer_id)

    def reap(self) -> None:
        with self._lock:
            self._reap_locked(time.monotonic())

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._conns):
            conn.close()
        self._threads.join()

    # -- state transitions (hold the lock) ---------------------------------------------------
    def _finish(self, t: Incoming, state: TransferState, cause: FailureCause | None = None) -> None:
        if t.state.terminal:
            return
        t.state = state
        if state is TransferState.DONE:
            self.stats.transfers_received += 1
            backend = t.conn.backend if t.conn else "unknown"
            self.stats.received_by_backend[backend] += t.nbytes
            if t.heads is not None:
                self.stats.descriptors_received_by_backend[backend] += t.descriptors
            self.stats.receive_seconds += time.monotonic() - t.started
            self.completions.received(t.transfer_id)
        else:
            assert cause is not None
            self.stats.failures[cause.value] += 1
            self.completions.failed(t.transfer_id, cause)
        self._lock.notify_all()

    def _stop(self, t: Incoming, cause: FailureCause) -> None:
        """Fail ``t`` as soon as nothing can write into its blocks any more.

        Not begun, or its connection gone: fail now. Our own reader mid-payload (tcp, nccl):
        fail when that read returns. A direct-write sender: ask it to stop and fail on its
        ``aborted`` (or when its connection ends). Begun senders are told to stop either way.
        """
        if t.state.terminal or t.stopping is not None:
            return
        live = t.state is TransferState.TRANSFERRING and t.conn is not None and not t.conn.closed.is_set()
        if live and t.conn is not None:
            self._threads.spawn(self._send_abort, t.conn, t.transfer_id, cause, name="kv-abort")
        if live and (t.direct_write or t.receiving):
            t.stopping = cause
            return
        self._finish(t, TransferState.FAILED, cause)

    def _send_abort(self, conn: Connection, transfer_id: str, cause: FailureCause) -> None:
        try:
            conn.send("abort", id=transfer_id, reason=cause.value)
        except TransferError:
            self._on_conn_lost(conn)

    def _reap_locked(self, now: float) -> None:
        for t in self._transfers.values():
            if t.state.terminal or now <= t.deadline:
                continue
            self._stop(t, FailureCause.TIMEOUT)
            if t.stopping is not None and t.direct_write and now > t.deadline + self.fence_grace_s:
                # Past the fence the sender starts no write, and the grace covers one already
                # under way; it broke the protocol by not confirming, so its connection goes too.
                log.warning(
                    "kv transfer %s: sender %s never confirmed it stopped; blocks released at the "
                    "write fence and the connection closed",
                    t.transfer_id,
                    t.conn.peer if t.conn else "?",
                )
                self._finish(t, TransferState.FAILED, t.stopping)
                if t.conn is not None:
                    self._threads.spawn(t.conn.close, name="kv-fence-close")

    # -- connections -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        self._listener.settimeout(0.1)  # closing a socket does not wake a blocked accept()
        while not self._closed.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                conn = Connection(sock, self.peering.io_timeout_s, f"{addr[0]}:{addr[1]}")
            except OSError:  # the peer reset it already
                sock.close()
                continue
            with self._lock:
                shed = self._pending.admit(conn, addr[0])
                self._conns.add(conn)
            for old in shed:  # its handshake's read ends, and its thread with it
                log.info("kv listener: %s had not authenticated; closed for a newer connection", old.peer)
                old.close()
            self._threads.spawn(self._serve, conn, name=f"kv-recv-{addr[1]}")

    def _serve(self, conn: Connection) -> None:
        try:
            features = list(FEATURES)
            # Our layout and block count: a sender checks head slices against them, and a
            # direct-write sender maps our cache by them.
            mine = {"features": features, "layout": self.peering.layout, "num_blocks": self.num_blocks}
            offers = {name: {**p.receiver_info(), **mine} for name, p in self.paths.items()}
            peering = self.peering
            hello = server_handshake(
                conn, peering.secret, peering.layout, offers, peering.tls, peering.handshake_timeout_s
            )
            with self._lock:
                self._pending.settled(conn)
                full = len(self._conns) - len(self._pending) > MAX_CONNECTIONS
            if full:
                raise TransferError(FailureCause.REJECTED, f"more than {MAX_CONNECTIONS} senders connected")
            path = self.paths[conn.backend]
            path.accept(conn, hello)
            while True:
                frame = conn.read_frame(idle=True)
                self._dispatch(conn, path, frame)
        except (TransferError, wire.FrameError) as e:
            if not self._closed.is_set():
                log.info("kv connection from %s ended: %s", conn.peer, e)
        finally:
            conn.close()
            self._on_conn_lost(conn)

    def _on_conn_lost(self, conn: Connection) -> None:
        path = self.paths.get(conn.backend)
        if path is not None:
            path.detach(conn)
        with self._lock:
            self._conns.discard(conn)
            self._pending.settled(conn)
            for t in self._transfers.values():
                if t.conn is conn and not t.state.terminal:
                    self._finish(t, TransferState.FAILED, t.stopping or FailureCause.PEER_LOST)

    def _ignore(self, conn: Connection, frame: dict[str, Any], path: DataPath) -> None:
        self.stats.ignored_frames += 1
        if frame["t"] == "data":
            if frame["count"] > self.num_blocks or frame.get("heads", 0) > self.num_heads:
                claim = f"{frame['count']} blocks of {frame.get('heads', self.num_heads)} heads"
                raise TransferError(FailureCause.PROTOCOL, f"data frame claims {claim}")
            path.discard_data(conn, frame)

    def _dispatch(self, conn: Connection, path: DataPath, frame: dict[str, Any]) -> None:
        kind = frame["t"]
        handler: Callable[[Connection, DataPath, dict[str, Any]], None] | None = {
            "begin": self._on_begin,
            "data": self._on_data,
            "layer": self._on_layer,
            "done": self._on_done,
            "abort": self._on_abort,
            "aborted": self._on_aborted,
        }.get(kind)
        if handler is None:
            raise TransferError(FailureCause.PROTOCOL, f"unexpected {kind} frame from a sender")
        handler(conn, path, frame)

    def _active(self, conn: Connection, transfer_id: str) -> Incoming | None:
        t = self._transfers.get(transfer_id)
        if t is None or t.state is not TransferState.TRANSFERRING or t.conn is not conn or t.stopping:
            return None
        return t

    def _on_begin(self, conn: Connection, path: DataPath, f: dict[str, Any]) -> None:
        heads = HeadSlice.from_wire(f.get("heads"))
        cause = FailureCause.REJECTED
        with self._lock:
            t = self._transfers.get(f["id"])
            reason = None
            if t is None or t.state is not TransferState.BOOTSTRAPPING:
                reason = "unknown or finished transfer"
            elif tuple(f["dst_blocks"]) != t.dst_blocks:
                reason = "destination blocks differ from the reservation"
            elif f["num_layers"] != t.num_layers:
                reason = f"{f['num_layers']} layers, expected {t.num_layers}"
            elif (reason := self._heads_problem(conn, heads)) is not None:
                cause = FailureCause.LAYOUT_MISMATCH
            elif (heads is None) != (t.heads is None) or (
                heads is not None and t.heads is not None and not heads.same_destination(t.heads)
            ):
                reason = f"head slice {heads} differs from the expected {t.heads}"
            if reason is not None:
                # A begun transfer is left alone: another begin must not fail it under its sender.
                if t is not None and t.state is TransferState.BOOTSTRAPPING:
                    self._finish(t, TransferState.FAILED, cause)
                self.stats.ignored_frames += 1
            else:
                assert t is not None
                t.state = TransferState.TRANSFERRING
                t.conn = conn
                t.direct_write = path.direct_write
                t.heads = heads
                t.started = time.monotonic()
        if reason is not None:
            conn.send("reject", id=f["id"], reason=reason, cause=cause.value)
        elif path.direct_write:
            assert t is not None
            conn.send("ready", id=f["id"], write_until_ns=int(t.deadline * 1e9))
        else:
            conn.send("ready", id=f["id"])

    def _heads_problem(self, conn: Connection, heads: HeadSlice | None) -> str | None:
        """Why a transfer with ``heads`` from ``conn``'s sender cannot land here, or None."""
        src_heads = heads_of(conn.peer_layout)
        if src_heads is None:  # the handshake checked it; a connection set up otherwise is not ours
            return "the sender's layout is unknown"
        return transfer_problem(heads, src_heads, self.num_heads)

    def _on_data(self, conn: Connection, path: DataPath, f: dict[str, Any]) -> None:
        if path.direct_write:
            raise TransferError(FailureCause.PROTOCOL, f"data frame on a {path.name} connection")
        with self._lock:
            t = self._active(conn, f["id"])
            if t is not None:
                if f["layer"] >= t.num_layers or f["first"] != t.received.get(f["layer"], 0):
                    raise TransferError(FailureCause.PROTOCOL, f"data frame out of order: {f}")
                if f.get("heads") != (t.heads.count if t.heads else None):
                    raise TransferError(
                        FailureCause.PROTOCOL, f"data frame's heads differ from its begin: {f}"
                    )
                t.receiving = True
        if t is None:
            self._ignore(conn, f, path)
            return
        # Only this connection's reader writes these blocks; the flag keeps a concurrent
        # lease expiry or cancel from releasing them until the read returns.
        try:
            if t.heads is None:
                n, copies = path.receive_data(conn, f, t.dst_blocks), 0
            else:
                moved = path.receive_slice(conn, f, t.dst_blocks, t.heads)
                n, copies = moved.nbytes, moved.descriptors
        finally:
            with self._lock:
                t.receiving = False
                if t.stopping is not None:
                    self._finish(t, TransferState.FAILED, t.stopping)
        with self._lock:
            if t.state.terminal:
                return
            t.nbytes += n
            t.descriptors += copies
            got = t.received.get(f["layer"], 0) + f["count"]
            t.received[f["layer"]] = got
            if got >= len(t.dst_blocks):
                t.layers.add(f["layer"])
                self._lock.notify_all()
            if f.get("done"):
                self._end(t)

    def _on_layer(self, conn: Connection, path: DataPath, f: dict[str, Any]) -> None:
        if not path.direct_write:
            raise TransferError(FailureCause.PROTOCOL, f"layer frame on a {path.name} connection")
        first, count = f["layer"], f["count"]
        if count == 0 or first + count > self.num_layers:
            raise TransferError(FailureCause.PROTOCOL, f"layers {first}..{first + count} out of range")
        with self._lock:
            t = self._active(conn, f["id"])
            if t is None:
                self.stats.ignored_frames += 1
                return
            t.layers.update(range(first, first + count))
            per_block = slice_block_nbytes(path.cache, t.heads.count) if t.heads else path.block_nbytes
            t.nbytes += count * len(t.dst_blocks) * per_block
            self._lock.notify_all()
            if f.get("done"):
                self._end(t)

    def _on_done(self, conn: Connection, path: DataPath, f: dict[str, Any]) -> None:
        with self._lock:
            t = self._active(conn, f["id"])
            if t is None:
                self.stats.ignored_frames += 1
                return
            self._end(t)

    def _end(self, t: Incoming) -> None:
        """The sender says it sent everything (caller holds the lock): DONE if every layer is
        here in full, a protocol failure otherwise."""
        if len(t.layers) == t.num_layers:
            self._finish(t, TransferState.DONE)
        else:
            self._finish(t, TransferState.FAILED, FailureCause.PROTOCOL)

    def _on_abort(self, conn: Connection, path: DataPath, f: dict[str, Any]) -> None:
        # The sender gave up; it sends this only after it stopped writing.
        with self._lock:
            t = self._transfers.get(f["id"])
            if t is not None and t.conn is conn:
                self._finish(t, TransferState.FAILED, t.stopping or FailureCause.CANCELLED)

    def _on_aborted(self, conn: Connection, path: DataPath, f: dict[str, Any]) -> None:
        with self._lock:
            t = self._transfers.get(f["id"])
            if t is not None and t.conn is conn and t.stopping is not None:
                self._finish(t, TransferState.FAILED, t.stopping)
