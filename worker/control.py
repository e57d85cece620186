"""Process-level control of a worker: frozen messages, and the one table that runs them on a
worker host (pure Python).

Request commands (``pdserve.worker.commands``) act on one request and travel on the worker
channel, in order with the worker's outputs. Control messages act on the worker process
itself (its info and load, its role, its state checks, its end) and go through the worker's
``Caller`` instead (``pdserve.router.workers``): the Ray actor's one ``control`` method in a
cluster, a thread pool around the host in process. They work before the channel is up and
after it is gone.

Each message is typed by its answer (``Control[T]``), so ``await handle.control(GetLoad())`` is
a ``WorkerLoad``. Every worker role answers every control message: one table for all, keyed by
the message's type, dispatched by ``run_control`` (``WorkerHost.control``). A failure raises in
the caller as the worker raised it (``ValueError``: e.g. a switch refused while requests are
held); a message the table lacks raises ``UnsupportedCommand``.

Adding a control message: one frozen dataclass here, one entry in ``CONTROL_HANDLERS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

from pdserve.worker.commands import UnsupportedCommand
from pdserve.worker.messages import WorkerInfo, WorkerLoad, WorkerRole

T = TypeVar("T")


class Control(Generic[T]):
    """A control message whose answer is a ``T``."""

    __slots__ = ()


@dataclass(frozen=True)
class GetInfo(Control[WorkerInfo]):
    """What the worker is (ready once it answers)."""


@dataclass(frozen=True)
class GetLoad(Control[WorkerLoad]):
    """Its load as of its last step or command (no wait on a running step)."""


@dataclass(frozen=True)
class SwitchRole(Control[WorkerInfo]):
    """Run as ``role`` from now on, keeping the weights and the KV pool; answers the new info.
    Refused (``ValueError``) while the worker holds requests or for a role it cannot run."""

    role: WorkerRole


@dataclass(frozen=True)
class SetLeaving(Control[None]):
    """Report DRAINING (``leaving``) or HEALTHY again in every load: a planned change is taking
    the worker out of its pool, and router replicas, which learn of it only from its loads,
    must route nothing new to it. A worker draining after SIGTERM stays DRAINING."""

    leaving: bool


@dataclass(frozen=True)
class RequestState(Control[dict[str, int]]):
    """Sizes of every per-request map of the engine, its KV manager and its transport."""


@dataclass(frozen=True)
class CheckIntegrity(Control[None]):
    """Raise if blocks or per-request state leaked (checked while no request is held)."""


@dataclass(frozen=True)
class Shutdown(Control[None]):
    """Stop the worker: its channel, its loop, its transport."""


class ControlTarget(Protocol):
    """What the control messages act on (``pdserve.worker.host.WorkerHost``)."""

    def info(self) -> WorkerInfo: ...

    def load(self) -> WorkerLoad: ...

    def switch_role(self, role: WorkerRole) -> WorkerInfo: ...

    def set_leaving(self, leaving: bool) -> None: ...

    def request_state(self) -> dict[str, int]: ...

    def check_integrity(self) -> None: ...

    def shutdown(self) -> None: ...


# (host, message) -> answer
ControlHandler = Callable[[ControlTarget, Any], object]

CONTROL_HANDLERS: Mapping[type, ControlHandler] = {
    GetInfo: lambda host, m: host.info(),
    GetLoad: lambda host, m: host.load(),
    SwitchRole: lambda host, m: host.switch_role(m.role),
    SetLeaving: lambda host, m: host.set_leaving(m.leaving),
    RequestState: lambda host, m: host.request_state(),
    CheckIntegrity: lambda host, m: host.check_integrity(),
    Shutdown: lambda host, m: host.shutdown(),
}


def run_control(host: ControlTarget, msg: Control[T]) -> T:
    """Run ``msg`` on ``host`` (on the caller's thread: each handler hands engine work to the
    host's loop itself); its answer."""
    handler = CONTROL_HANDLERS.get(type(msg))
    if handler is None:
        raise UnsupportedCommand(f"no control message {type(msg).__name__}")
    return cast(T, handler(host, msg))
