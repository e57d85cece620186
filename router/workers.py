"""The router's handles on its workers: commands, control messages and health.

A ``WorkerHandle`` wraps one worker process: its request commands go over its worker channel,
its control messages (``pdserve.worker.control``: info, load, role switch, state checks,
shutdown) through a ``Caller`` (the Ray actor's one ``control`` method in a cluster, a thread
pool around an in-process ``WorkerHost`` in tests and single-process mode); both are typed
messages, never method names.
Outputs do not come through it: they arrive over the worker's output channel
(``pdserve.router.outputs``), each batch with the worker's load for the routing policy. A worker whose
channel closes is marked UNHEALTHY (terminal) and the router moves or fails the requests it
held. A worker that reports DRAINING (it was told to stop, e.g. SIGTERM) gets no new requests
but keeps its commands (starts, aborts) until its channel ends.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any, Protocol, TypeVar, cast

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.worker.control import Control, GetLoad, Shutdown
from pdserve.worker.messages import WorkerHealth, WorkerInfo, WorkerLoad

T = TypeVar("T")


class Caller(Protocol):
    """Delivers a worker's control messages to its process; ``kill`` ends the process."""

    async def control(self, msg: Control[T], timeout_s: float | None = None) -> T: ...

    def kill(self) -> None: ...


class ControlHost(Protocol):
    def control(self, msg: Control[T]) -> T: ...


class LocalCaller:
    """Runs control messages on an in-process worker host, on a thread pool (no Ray)."""

    def __init__(self, host: ControlHost, pool: ThreadPoolExecutor) -> None:
        self.host = host
        self.pool = pool

    async def control(self, msg: Control[T], timeout_s: float | None = None) -> T:
        fut = asyncio.get_running_loop().run_in_executor(self.pool, self.host.control, msg)
        return await asyncio.wait_for(fut, timeout_s) if timeout_s else await fut

    def kill(self) -> None:
        self.host.control(Shutdown())


class NotOwner(Exception):
    """A router replica asked for what only the pool owner does (stop, switch, inspect a
    worker's process)."""


class AttachedCaller:
    """A router replica's ``Caller`` for a worker the pool owner started: that process is not
    this router's to control. ``GetLoad`` is answered with the load the worker last reported on
    its channel (every frame carries one, at least every half second); every other control
    message raises ``NotOwner``; ``kill`` does nothing (the owner stops or replaces workers)."""

    def __init__(self) -> None:
        self.handle: WorkerHandle | None = None  # set by ``attached``

    async def control(self, msg: Control[T], timeout_s: float | None = None) -> T:
        if isinstance(msg, GetLoad) and self.handle is not None:
            return cast(T, self.handle.load)
        raise NotOwner(f"a router replica cannot send {type(msg).__name__}: the pool owner controls workers")

    def kill(self) -> None:
        pass


def attached(info: WorkerInfo) -> WorkerHandle:
    """A replica's handle on the worker ``info`` describes (``AttachedCaller``)."""
    caller = AttachedCaller()
    handle = caller.handle = WorkerHandle(info, caller)
    return handle


class WorkerLost(Exception):
    """A worker stopped answering: its process died or its loop failed."""


class Leaving(Enum):
    """A worker's part in a planned change of the pools (``Membership.retire``, ``Membership.switch_role``)::

        STAYING --change begins--> DRAINING --requests ended, or the drain ran out--> COMMITTED
           ^                          |                                                |
           |                          | the change would leave no worker to decode:    | retired, or
           +--------------------------+ given up, it takes requests again              | serving in its
           +-------------------------------------------------------------------------- + new role

    A DRAINING worker is routed nothing new but keeps what it holds; a COMMITTED one is past
    the point where the change can be given up (its requests are being moved off).
    """

    STAYING = "staying"
    DRAINING = "draining"
    COMMITTED = "committed"


class CommandSender(Protocol):
    """The worker channel's command side (``pdserve.router.outputs.CommandChannel``)."""

    def send(self, cmd: Any) -> asyncio.Future[Any]: ...

    @property
    def waiting(self) -> int: ...  # commands sent and not answered yet


class WorkerHandle:
    """One worker: commands (``command``) go over its authenticated worker channel, in order;
    control messages (``control``: info, load, role switch, state checks, shutdown) through its
    ``Caller``."""

    def __init__(self, info: WorkerInfo, caller: Caller) -> None:
        self.info = info
        self.caller = caller
        self.worker_id = info.worker_id
        self.role = info.role
        self.health = WorkerHealth.HEALTHY
        blocks = info.kv_blocks
        self.load = WorkerLoad(info.worker_id, info.role, info.address, 0, 0, blocks, blocks, 0)
        self.inflight: set[str] = set()
        self.channel: CommandSender | None = None  # set once its channel is authenticated
        self.leaving = Leaving.STAYING
        self.kept_because = ""  # why its last planned change was given up ("": it was not)
        self.released = False  # draining after SIGTERM, it was sent ``Release``: it may go

    @property
    def alive(self) -> bool:
        """It may still hold requests and take commands (healthy or draining)."""
        return self.health is not WorkerHealth.UNHEALTHY

    @property
    def retiring(self) -> bool:
        """A planned change is taking it out of its pool (``Leaving``)."""
        return self.leaving is not Leaving.STAYING

    @property
    def routable(self) -> bool:
        """New requests may go here: healthy, with its channel up, not being retired."""
        return self.health is WorkerHealth.HEALTHY and self.channel is not None and not self.retiring

    @property
    def held(self) -> bool:
        """Draining after SIGTERM and not released yet: it still takes new requests while no
        other worker of its role does (``Router._decoders``)."""
        return (
            self.health is WorkerHealth.DRAINING
            and self.channel is not None
            and not self.released
            and not self.retiring
        )

    def report(self, load: WorkerLoad) -> None:
        """The worker's latest load, and with it whether it is draining (lost is terminal)."""
        self.load = load
        if self.alive and load.health in (WorkerHealth.HEALTHY, WorkerHealth.DRAINING):
            self.health = load.health

    def mark_lost(self) -> None:
        self.health = WorkerHealth.UNHEALTHY

    def send(self, cmd: Any) -> asyncio.Future[Any]:
        """Send a ``pdserve.worker.commands`` command now (one worker's commands arrive in the
        order sent); the future holds its answer. Raises ``WorkerLost`` when the worker is gone;
        the future raises it when the channel ends first, ``InvalidRequestError`` /
        ``ValueError`` when the request is at fault."""
        if self.health is WorkerHealth.UNHEALTHY or self.channel is None:
            raise WorkerLost(f"worker {self.worker_id} is unavailable")
        return self.channel.send(cmd)

    async def command(self, cmd: Any, timeout_s: float) -> Any:
        """``send``, and its answer (``asyncio.TimeoutError`` after ``timeout_s``)."""
        return await asyncio.wait_for(self.send(cmd), timeout_s)

    async def control(self, msg: Control[T], timeout_s: float | None = None) -> T:
        """Run a ``pdserve.worker.control`` message on the worker; its answer. Raises
        ``WorkerLost`` when the worker is gone or failed it for a reason of its own,
        ``InvalidRequestError`` / ``ValueError`` as the worker raised them (e.g. a role switch
        refused), ``asyncio.TimeoutError`` after ``timeout_s``."""
        if self.health is WorkerHealth.UNHEALTHY:
            raise WorkerLost(f"worker {self.worker_id} is unavailable")
        try:
            return await self.caller.control(msg, timeout_s=timeout_s)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            raise
        except Exception as e:
            if _is_request_error(e):
                raise
            first_line = str(e).strip().split("\n", 1)[0]
            raise WorkerLost(f"worker {self.worker_id}: {type(e).__name__}: {first_line}") from e


def _is_request_error(e: BaseException) -> bool:
    """Errors about the request (bad input), not the worker; Ray wraps them in its own type."""
    if isinstance(e, (InvalidRequestError, ValueError)):
        return True
    cause = getattr(e, "cause", None)
    return isinstance(cause, (InvalidRequestError, ValueError))
