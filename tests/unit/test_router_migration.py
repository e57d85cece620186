"""The router's migration logic against scripted workers (no processes): each worker's command
channel records what the router sends, and the test answers, emits deltas and loses workers at
chosen moments, including the races a real deployment only hits now and then."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.outputs import CommandChannel, OutputListener
from pdserve.router.service import GenerateInput, Router
from pdserve.router.workers import WorkerHandle
from pdserve.worker import commands as C
from pdserve.worker.command_codec import decode_command
from pdserve.worker.messages import KVTarget, TokenDelta, WorkerInfo, WorkerRole

GREEDY = SamplingParams(max_tokens=8, temperature=0)


class Recorder:
    """Stands in for a worker's socket writer: keeps the command frames the router wrote."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)


class NoCalls:
    async def control(self, msg: Any, timeout_s: float | None = None) -> Any:
        raise RuntimeError("no control messages here")

    def kill(self) -> None:
        pass


class Worker:
    def __init__(self, wid: str, role: WorkerRole) -> None:
        address = "" if role is WorkerRole.PREFILL else "127.0.0.1:1"
        info = WorkerInfo(
            wid, role, address, "/m/tiny", "llama", 1000, 4096, 16, "float32", 512, 20, False, 1, "host", 256
        )
        self.handle = WorkerHandle(info, NoCalls())
        self.out = Recorder()
        self.handle.channel = CommandChannel(wid, self.out)  # type: ignore[arg-type]

    def commands(self) -> list[tuple[int, Any]]:
        """Commands sent since the last look."""
        out = [decode_command(frame[4:]) for frame in self.out.frames]
        self.out.frames.clear()
        return out

    def answer(self, call_id: int, value: Any) -> None:
        assert self.handle.channel is not None
        self.handle.channel.answered(call_id, value)  # type: ignore[attr-defined]


def cluster(
    roles: list[tuple[str, WorkerRole]], colocated: bool = False, **cfg: Any
) -> tuple[Router, dict[str, Worker]]:
    ws = {wid: Worker(wid, role) for wid, role in roles}
    router = Router(RouterConfig(**cfg), [w.handle for w in ws.values()], None, OutputListener(b"x" * 16),
                    colocated=colocated)  # fmt: skip
    return router, ws


async def lose(router: Router, w: Worker) -> None:
    """What the listener does when a worker's connection ends."""
    assert w.handle.channel is not None
    w.handle.channel.close("gone")  # type: ignore[attr-defined]
    w.handle.mark_lost()
    await router.membership.on_lost(w.handle, "gone")


async def consume(router: Router, admitted: Any, events: list[Any]) -> None:
    """Read a request's events as a client would; an error ends the list."""
    try:
        async for ev in router.run(admitted):
            events.append(ev)
    except Exception as e:
        events.append(e)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.005)


def test_a_migrated_stream_is_not_failed_by_its_old_attempt() -> None:
    """The old dispatch's command fails (the channel closed) just as the migration cancels it:
    whatever that attempt raises must not fail the stream that moved on."""

    async def main() -> None:
        router, ws = cluster([("c0", WorkerRole.COLOCATED), ("c1", WorkerRole.COLOCATED)], colocated=True,
                             policy="round_robin")  # fmt: skip
        admitted = router.admit(GenerateInput([5, 6, 7], GREEDY))
        events: list[Any] = []
        task = asyncio.create_task(consume(router, admitted, events))
        await settle()
        first = ws[admitted.stream.decode_worker]
        other = ws["c1" if first.handle.worker_id == "c0" else "c0"]
        await lose(router, first)  # its AddLocal is still waiting for an answer
        await settle()
        assert admitted.stream.migrations == 1 and not admitted.stream.done, events
        assert [type(c) for _, c in other.commands()] == [C.AddLocal]
        task.cancel()

    asyncio.run(main())


def test_a_stream_that_already_ended_is_not_moved() -> None:
    """Aborted (its Final queued, its consumer still busy) when its worker is lost: nothing is
    sent anywhere, and no per-request state is left in the router or its dispatcher."""

    async def main() -> None:
        router, ws = cluster([("c0", WorkerRole.COLOCATED), ("c1", WorkerRole.COLOCATED)], colocated=True)
        admitted = router.admit(GenerateInput([5, 6, 7], GREEDY, request_id="client-1"))
        gate = asyncio.Event()
        events: list[Any] = []

        async def consume() -> None:
            async for ev in router.run(admitted):
                events.append(ev)
                if len(events) == 1:
                    await gate.wait()

        task = asyncio.create_task(consume())
        await settle()
        w = ws[admitted.stream.decode_worker]
        for call_id, _ in w.commands():
            w.answer(call_id, None)
        router.flow.on_deltas(w.handle, (TokenDelta(admitted.stream.request_id, (11,)),))
        await settle()
        assert await router.abort("client-1")
        await lose(router, w)  # in the window before its consumer cleans up
        gate.set()
        await task
        await settle()
        other = ws["c1" if w.handle.worker_id == "c0" else "c0"]
        assert admitted.stream.migrations == 0 and other.commands() == [] and not other.handle.inflight
        assert not router._streams and not router._client_ids
        assert not router.dispatcher._placed  # type: ignore[attr-defined]

    asyncio.run(main())


def test_the_old_reservation_does_not_settle_the_new_attempts() -> None:
    """The prefill worker is lost before the first token while decode's reservation waits for
    room: the new attempt must still send Start once its own reservation is granted."""

    async def main() -> None:
        roles = [("p0", WorkerRole.PREFILL), ("p1", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE)]
        router, ws = cluster(roles, policy="goodput", local_prefill=False)
        admitted = router.admit(GenerateInput([5, 6, 7], GREEDY))
        task = asyncio.create_task(_drain(router.run(admitted)))
        await settle()
        stream, d = admitted.stream, ws["d0"]
        p = ws[stream.prefill_worker]
        for call_id, _ in p.commands():
            p.answer(call_id, None)
        (queued,) = d.commands()
        d.answer(queued[0], True)  # waiting for room
        await settle()
        assert [type(c) for _, c in d.commands()] == [C.AwaitReservation]
        await lose(router, p)
        await settle()
        assert stream.attempt is not None and stream.attempt.target is None  # the new one's
        p2 = ws[stream.prefill_worker]
        for call_id, _ in p2.commands():
            p2.answer(call_id, None)
        sent = d.commands()
        assert [type(c) for _, c in sent] == [C.Abort, C.QueueReservation]
        first = TokenDelta(stream.request_id, (42,), prefilled=True)
        router.flow.on_deltas(p2.handle, (first,))  # before room
        d.answer(sent[1][0], True)
        await settle()
        (awaiting,) = d.commands()
        d.answer(awaiting[0], KVTarget("kv-1", "127.0.0.1:1", ("tcp",), (1,)))
        await settle()
        assert [type(c) for _, c in d.commands()] == [C.Start]
        task.cancel()

    asyncio.run(main())


async def _drain(events: Any) -> None:
    async for _ in events:
        pass


def test_a_reservation_failed_by_its_dying_worker_moves_the_request() -> None:
    """Decode's loop stops while a reservation waits (the worker answers FAILED before its
    channel ends): the request goes to another decode worker; the client sees no
    RESOURCE_EXHAUSTED for a fault that was not its own."""

    async def main() -> None:
        roles = [("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE), ("d1", WorkerRole.DECODE)]
        router, ws = cluster(roles, policy="round_robin")
        admitted = router.admit(GenerateInput([5, 6, 7], GREEDY))
        events: list[Any] = []
        task = asyncio.create_task(consume(router, admitted, events))
        await settle()
        first = ws[admitted.stream.decode_worker]
        queued = {type(c): i for i, c in first.commands()}
        first.answer(queued[C.QueueReservation], True)
        await settle()
        [(await_id, waiting)] = first.commands()
        assert isinstance(waiting, C.AwaitReservation)
        first.answer(await_id, C.CommandError(C.ErrorKind.FAILED, "WorkerFailed: worker loop stopped"))
        for call_id, cmd in ws["p0"].commands():
            assert isinstance(cmd, C.Prefill)
            ws["p0"].answer(call_id, None)
        await settle()
        assert admitted.stream.migrations == 1 and not admitted.stream.done, events
        other = ws["d1" if first.handle.worker_id == "d0" else "d0"]
        assert C.QueueReservation in {type(c) for _, c in other.commands()}
        task.cancel()

    asyncio.run(main())
