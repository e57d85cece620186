"""The router spreads prompts that have not started when the prefill pool changes, against
scripted workers (no processes): which prompts it takes back, what it sends where, and the
races with a prompt that starts, or a client that leaves, while the ``Withdraw`` is on its way."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from pdserve.router.service import GenerateInput, Router
from pdserve.router.slo import SloClass
from pdserve.worker import commands as C
from pdserve.worker.messages import KVTarget, TokenDelta, WorkerHealth, WorkerRole
from tests.unit.test_router_migration import GREEDY, Worker, cluster, consume, settle

PROMPT = list(range(3, 303))  # 300 tokens: more than a scripted worker's step (256)


def answer(ws: dict[str, Worker], withdraw: dict[str, bool] | None = None) -> list[tuple[str, Any]]:
    """Answer every command sent since the last look as a worker would (a reservation at once,
    ``Withdraw`` as ``withdraw`` says for the request, no by default); what was sent, by worker."""
    sent = []
    for wid, w in ws.items():
        for call_id, cmd in w.commands():
            sent.append((wid, cmd))
            value: Any = None
            if isinstance(cmd, C.QueueReservation):
                value = True
            elif isinstance(cmd, C.AwaitReservation):
                value = KVTarget(f"kv-{cmd.request_id}", "127.0.0.1:1", ("tcp",), tuple(range(19)))
            elif isinstance(cmd, C.Withdraw):
                value = (withdraw or {}).get(cmd.request_id, False)
            elif isinstance(cmd, (C.SetTarget, C.Abort)):
                value = True
            w.answer(call_id, value)
    return sent


async def start(router: Router, n: int) -> tuple[list[Any], list[asyncio.Task[None]]]:
    admitted = [router.admit(GenerateInput(PROMPT, GREEDY, request_id=f"client-{i}")) for i in range(n)]
    tasks = [asyncio.create_task(consume(router, a, [])) for a in admitted]
    await settle()
    return admitted, tasks


async def backlog(n: int, **cfg: Any) -> tuple[Router, dict[str, Worker], list[Any], list[Any]]:
    """One prefill and one decode worker (least-loaded routing) holding ``n`` prompts sent and
    answered, none started."""
    roles = [("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE)]
    router, ws = cluster(roles, policy="least_loaded", **cfg)
    admitted, tasks = await start(router, n)
    answer(ws)
    return router, ws, admitted, tasks


def joined(router: Router, ws: dict[str, Worker], wid: str) -> Worker:
    """A prefill worker starts at run time and its channel comes up."""
    w = ws[wid] = Worker(wid, WorkerRole.PREFILL)
    router.membership.add_worker(w.handle)
    router.membership.on_pool_change(w.handle)
    return w


async def end_all(router: Router, ws: dict[str, Worker], admitted: list[Any], tasks: list[Any]) -> None:
    """Every client leaves; the workers answer the aborts: nothing is left in the router."""
    for a in admitted:
        await router.abort(a.stream.client_id)
    for _ in range(3):
        await settle()
        answer(ws)
    await asyncio.gather(*tasks)
    await settle()
    assert not any(router.request_state().values()), router.request_state()
    assert all(not w.handle.inflight for w in ws.values())


def test_a_joined_prefill_worker_takes_the_newest_prompts_that_had_not_started() -> None:
    async def main() -> None:
        router, ws, admitted, tasks = await backlog(5)
        first = admitted[0].stream
        router.flow.on_deltas(ws["p0"].handle, (TokenDelta(first.request_id, (42,), prefilled=True),))
        await settle()
        answer(ws)
        old = [a.stream.request_id for a in admitted]
        p1 = joined(router, ws, "p1")
        await settle()
        # four queued prompts of 300 tokens, two workers: the two newest go
        withdrawn = [(wid, c) for wid, c in answer(ws, {old[4]: True}) if isinstance(c, C.Withdraw)]
        assert withdrawn == [("p0", C.Withdraw(old[4])), ("p0", C.Withdraw(old[3]))]
        await settle()
        moved, stayed = admitted[4].stream, admitted[3].stream
        assert moved.request_id != old[4] and moved.prefill_worker == "p1" and moved.migrations == 0
        assert stayed.request_id == old[3] and stayed.prefill_worker == "p0"
        sent = answer(ws)
        assert ("p1", C.Prefill(replace(admitted[4].work, request_id=moved.request_id))) in sent
        assert ("d0", C.Abort(old[4])) in sent  # its old reservation is given back
        assert old[4] not in ws["p0"].handle.inflight and moved.request_id in p1.handle.inflight
        assert router.metrics.rerouted._value.get() == 1
        await end_all(router, ws, admitted, tasks)

    asyncio.run(main())


def test_a_prompt_whose_client_left_while_it_was_withdrawn_goes_nowhere() -> None:
    async def main() -> None:
        router, ws, admitted, tasks = await backlog(4)
        joined(router, ws, "p1")
        await settle()
        rids = [a.stream.request_id for a in admitted]
        withdraws = [(i, c) for i, c in ws["p0"].commands() if isinstance(c, C.Withdraw)]
        assert [c.request_id for _, c in withdraws] == [rids[3], rids[2]]
        await router.abort("client-3")  # before the worker's answer
        await settle()
        for call_id, _ in withdraws:
            ws["p0"].answer(call_id, True)
        await settle()
        assert [c for _, c in answer(ws) if isinstance(c, C.Prefill)] == [
            C.Prefill(replace(admitted[2].work, request_id=admitted[2].stream.request_id))
        ]
        assert admitted[3].stream.done and admitted[3].stream.request_id == rids[3]
        assert router.metrics.rerouted._value.get() == 1
        await end_all(router, ws, admitted, tasks)

    asyncio.run(main())


@pytest.mark.parametrize("how", ["retired", "sigterm"])
def test_a_prefill_worker_leaving_gives_its_queue_back_at_once(how: str) -> None:
    """Retired by the router, or draining after SIGTERM (it reports so): what it has not
    started goes to the other prefill worker at once."""

    async def main() -> None:
        roles = [("p0", WorkerRole.PREFILL), ("p1", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE)]
        router, ws = cluster(roles, policy="round_robin")
        admitted, tasks = await start(router, 4)
        answer(ws)
        on_p0 = [a.stream.request_id for a in admitted if a.stream.prefill_worker == "p0"]
        assert len(on_p0) == 2
        p0 = ws["p0"].handle
        retire = None
        if how == "retired":
            retire = asyncio.create_task(router.membership.retire("p0", drain_timeout_s=30))
        else:
            p0.report(replace(p0.load, health=WorkerHealth.DRAINING))
            router.membership.on_pool_change(p0)
        await settle()
        sent = answer(ws, dict.fromkeys(on_p0, True))
        assert [c.request_id for _, c in sent if isinstance(c, C.Withdraw)] == on_p0[::-1]
        if retire is not None:
            assert (await asyncio.wait_for(retire, 5)).clean  # nothing waited out the drain, or moved
            assert "p0" not in router.workers
            del ws["p0"]
        await settle()
        assert {a.stream.prefill_worker for a in admitted} == {"p1"} and not p0.inflight
        await end_all(router, ws, admitted, tasks)

    asyncio.run(main())


@pytest.mark.parametrize(
    "cfg",
    [
        {"rebalance_prefill": False},  # off: a prompt stays where it was sent
        # every prompt has used its whole TTFT budget: moved, it would make fresh ones late too
        {"slo_classes": (SloClass("tight", ttft_ms=1.0),)},
    ],
)
def test_nothing_moves_when_off_or_when_every_prompt_is_late(cfg: dict[str, Any]) -> None:
    async def main() -> None:
        router, ws, admitted, tasks = await backlog(4, **cfg)
        await asyncio.sleep(0.01)  # each has waited past 1 ms
        joined(router, ws, "p1")
        await settle()
        assert not [c for _, c in answer(ws) if isinstance(c, C.Withdraw)]
        await end_all(router, ws, admitted, tasks)

    asyncio.run(main())


def test_workers_joining_together_take_each_prompt_once() -> None:
    async def main() -> None:
        router, ws, admitted, tasks = await backlog(9)
        joined(router, ws, "p1")
        joined(router, ws, "p2")
        asked: list[str] = []
        for _ in range(4):  # the workers take back whatever they are asked for
            await settle()
            sent = answer(ws, {a.stream.request_id: True for a in admitted})
            asked += [c.request_id for _, c in sent if isinstance(c, C.Withdraw)]
        assert len(asked) == len(set(asked)) == 6, asked  # 2,700 tokens, a third each
        where = [a.stream.prefill_worker for a in admitted]
        assert where.count("p0") == 3 and where.count("p1") == 3 and where.count("p2") == 3, where
        await end_all(router, ws, admitted, tasks)

    asyncio.run(main())
