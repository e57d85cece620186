"""Router -> worker commands: frozen dataclasses and their answers (pure Python).

Their wire form is ``pdserve.worker.command_codec``; what each role does with each is its
handler table (``pdserve.worker.handlers``, one per role).

Who answers what: a prefill worker takes ``Prefill``, ``SetTarget``, ``Withdraw`` and
``Abort``; a decode worker ``QueueReservation``, ``AwaitReservation``, ``Start``, ``KvLost``,
``AddLocal`` and ``Abort``; every worker ``Release``. ``AwaitReservation`` is answered only once
the reservation is settled (granted, expired or aborted); every other command as soon as the
engine ran it between two steps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.worker.messages import KVTarget, WorkItem


@dataclass(frozen=True)
class Prefill:
    work: WorkItem
    target: KVTarget | None = None


@dataclass(frozen=True)
class SetTarget:
    request_id: str
    target: KVTarget


@dataclass(frozen=True)
class Withdraw:
    """Give back a prompt that has not started (answered True: the worker forgot it)."""

    request_id: str


@dataclass(frozen=True)
class QueueReservation:
    work: WorkItem
    transfer_id: str
    timeout_s: float
    source_ranks: int = 1  # the prefill worker's KV ranks: decode expects a part from each route


@dataclass(frozen=True)
class AwaitReservation:
    request_id: str


@dataclass(frozen=True)
class Start:
    request_id: str
    first_token: int
    cached_tokens: int


@dataclass(frozen=True)
class KvLost:
    request_id: str


@dataclass(frozen=True)
class AddLocal:
    work: WorkItem


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Release:
    """The router routes nothing new to this worker, which drains after SIGTERM: it may exit
    once idle. Until then a draining worker serves what it is sent (the last worker of its
    role keeps taking requests while its replacement starts). Answered True."""


Command = (
    Prefill
    | SetTarget
    | Withdraw
    | QueueReservation
    | AwaitReservation
    | Start
    | KvLost
    | AddLocal
    | Abort
    | Release
)
Answer = bool | KVTarget | None


class ErrorKind(enum.Enum):
    """Why a command failed: the request's fault (``INVALID``, ``VALUE``), or the worker's."""

    INVALID = "invalid"  # InvalidRequestError: a field is out of range (``field`` names it)
    VALUE = "value"  # ValueError: the request cannot be served here (e.g. an id already here)
    FAILED = "failed"  # the worker could not run it (its loop stopped, an internal error)
    UNSUPPORTED = "unsupported"  # this worker's role takes no such command


class UnsupportedCommand(Exception):
    """This worker's role takes no such command."""


@dataclass(frozen=True)
class CommandError:
    kind: ErrorKind
    message: str
    field: str | None = None

    def request_fault(self) -> Exception | None:
        """The exception for a failure that is the request's fault; ``None`` for the worker's
        (``FAILED``, ``UNSUPPORTED``: the caller treats the worker as gone)."""
        if self.kind is ErrorKind.INVALID:
            return InvalidRequestError(self.field or "request", self.message)
        if self.kind is ErrorKind.VALUE:
            return ValueError(self.message)
        return None
