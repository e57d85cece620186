"""How a role engine runs a router command: one handler table per role (pure dispatch).

A ``Handlers`` table maps a command's type to the function that runs it on the role's engine.
Every path that delivers commands uses the same table: the worker channel and the in-process
host (``WorkerHost.execute``, on the engine's loop thread, between steps) and the simulator
(``pdserve.simulator.sim_worker``, on the virtual clock). A command type missing from a role's
table is one that role does not take.

A handler returns the command's answer, or a ``Future`` of it for an answer that comes later
(``AwaitReservation``: once the reservation settles); callers wait on either the same way.

Adding a command: one frozen dataclass in ``pdserve.worker.commands`` (with its wire codec) and
one entry in the table of every role that takes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeAlias

from pdserve.worker.commands import Answer

# (engine, command) -> answer now, or a future of it
Handler: TypeAlias = Callable[[Any, Any], "Answer | Future[Answer]"]
Handlers: TypeAlias = Mapping[type, Handler]


def handler_for(table: Handlers, cmd: object) -> Handler | None:
    """The handler of ``cmd`` in ``table``; ``None`` when the role does not take it."""
    return table.get(type(cmd))


def resolve(out: Future[Answer], answer: Answer | Future[Answer]) -> None:
    """Resolve ``out`` with ``answer``, now or once its own future is done (its error, or its
    cancellation, passes through)."""
    if isinstance(answer, Future):
        answer.add_done_callback(lambda f: _copy(out, f))
    else:
        out.set_result(answer)


def answer_of(ran: Future[Answer | Future[Answer]]) -> Future[Answer]:
    """The answer of a handler run elsewhere (``ran``: its return value, on the engine's
    thread), a future either way."""
    out: Future[Answer] = Future()

    def done(f: Future[Answer | Future[Answer]]) -> None:
        try:
            answer = f.result()
        except BaseException as e:
            out.set_exception(e)
            return
        resolve(out, answer)

    ran.add_done_callback(done)
    return out


def _copy(out: Future[Answer], src: Future[Answer]) -> None:
    try:
        out.set_result(src.result())
    except BaseException as e:
        out.set_exception(e)
