"""Transfer states, failure causes, completion sets and counters (pure Python).

A transfer is identified by a router-minted, globally unique id. Each side keeps its own
record::

    receiver (decode):  expect() -> BOOTSTRAPPING --begin--> TRANSFERRING --all layers--> DONE
    sender (prefill):   send()   -> BOOTSTRAPPING --connected--> TRANSFERRING --pushed--> DONE
    either side:        any non-terminal state --error | peer lost | deadline | cancel--> FAILED

DONE and FAILED are terminal: frames arriving for a terminal (or unknown) transfer are drained
and ignored. Contract on blocks: the transport never frees blocks. The receiver's owner frees
the destination blocks on FAILED (on DONE they hold the request's KV); the sender's owner frees
the source blocks on DONE or FAILED — after either, the transport no longer reads them.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class FailureCause(enum.Enum):
    TIMEOUT = "timeout"  # a deadline or lease expired
    PEER_LOST = "peer_lost"  # connection closed or reset, process died
    PROTOCOL = "protocol"  # malformed, oversized or unexpected frame
    AUTH = "auth"  # wrong shared secret
    LAYOUT_MISMATCH = "layout_mismatch"  # the two caches disagree on shape or dtype
    CANCELLED = "cancelled"  # the owner aborted it
    UNREACHABLE = "unreachable"  # could not connect
    REJECTED = "rejected"  # the receiver refused the transfer (unknown id, wrong size)


class TransferError(Exception):
    """A transfer-level failure with its cause."""

    def __init__(self, cause: FailureCause, message: str) -> None:
        super().__init__(f"{cause.value}: {message}")
        self.cause = cause
        self.message = message


@dataclass
class Completions:
    """What finished since the last poll. Ids appear exactly once over a transport's life."""

    finished_sending: set[str] = field(default_factory=set)
    finished_receiving: set[str] = field(default_factory=set)
    failed: dict[str, FailureCause] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_receiving or self.failed)


@dataclass
class TransferStats:
    """Counters for metrics: bytes, seconds, outcomes; failures by cause."""

    transfers_sent: int = 0
    transfers_received: int = 0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)
    ignored_frames: int = 0
    connect_retries: int = 0  # sender: connections made again after a refusal or reset
    # Bytes by the backend that moved them (tcp, shm, ...): where a deployment's KV really goes.
    sent_by_backend: Counter[str] = field(default_factory=Counter)
    received_by_backend: Counter[str] = field(default_factory=Counter)
    # Copy operations of head-sliced transfers (``kvtransfer.slices``), by backend: one per layer
    # and run of blocks on each side that copies (whole-block transfers are not counted).
    descriptors_sent_by_backend: Counter[str] = field(default_factory=Counter)
    descriptors_received_by_backend: Counter[str] = field(default_factory=Counter)

    @property
    def bytes_sent(self) -> int:
        return sum(self.sent_by_backend.values())

    @property
    def bytes_received(self) -> int:
        return sum(self.received_by_backend.values())

    @property
    def descriptors_sent(self) -> int:
        return sum(self.descriptors_sent_by_backend.values())

    @property
    def descriptors_received(self) -> int:
        return sum(self.descriptors_received_by_backend.values())


class CompletionQueue:
    """Thread-safe accumulation of completions; ``drain`` hands them to the poller.

    ``listeners`` are called (outside the lock, from transport threads) after each completion,
    so a poller can sleep until there is something to drain instead of spinning.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = Completions()
        self.listeners: list[Callable[[], None]] = []

    def _notify(self) -> None:
        for cb in self.listeners:
            cb()

    def sent(self, transfer_id: str) -> None:
        with self._lock:
            self._pending.finished_sending.add(transfer_id)
        self._notify()

    def received(self, transfer_id: str) -> None:
        with self._lock:
            self._pending.finished_receiving.add(transfer_id)
        self._notify()

    def failed(self, transfer_id: str, cause: FailureCause) -> None:
        with self._lock:
            self._pending.failed[transfer_id] = cause
        self._notify()

    def drain(self) -> Completions:
        with self._lock:
            out, self._pending = self._pending, Completions()
        return out


class _HasState(Protocol):
    state: TransferState


T = TypeVar("T", bound=_HasState)


class TransferTable(Generic[T]):
    """Transfer records by id under one lock (a ``Condition`` on the receiver, to wait on)."""

    def __init__(self, lock: threading.Condition | threading.Lock) -> None:
        self._lock = lock
        self._transfers: dict[str, T] = {}

    def state(self, transfer_id: str) -> TransferState | None:
        with self._lock:
            t = self._transfers.get(transfer_id)
            return t.state if t else None

    def num_records(self) -> int:
        """Transfers this side still keeps a record of (0 once each was reported and forgotten)."""
        with self._lock:
            return len(self._transfers)

    def _pop_terminal(self, transfer_id: str) -> T | None:
        """Remove a finished record (caller holds the lock); ``None`` if absent or still live."""
        t = self._transfers.get(transfer_id)
        if t is None or not t.state.terminal:
            return None
        del self._transfers[transfer_id]
        return t
