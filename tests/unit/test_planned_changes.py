"""Planned changes of the pools (``Membership.retire``, ``Membership.switch_role``) against scripted
workers (no processes) when faults strike during them: a change that would leave no worker to
decode is given up and the draining worker takes the lost one's streams; moves a planned change
makes do not use up a stream's ``--migration-limit``, which only faults count against."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from pdserve.router.membership import PoolChange
from pdserve.router.service import GenerateInput, Router
from pdserve.worker.control import SwitchRole
from pdserve.worker.messages import WorkerHealth, WorkerRole
from tests.unit.test_router_migration import GREEDY, cluster, lose, settle
from tests.unit.test_router_rebalance import answer, end_all, start

P, D, COL = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.COLOCATED


def held_by(admitted: list[Any], wid: str) -> list[Any]:
    return [a for a in admitted if a.stream.decode_worker == wid]


async def change(router: Router, how: str, wid: str, drain_s: float) -> PoolChange:
    if how == "retire":
        return await router.membership.retire(wid, drain_timeout_s=drain_s)
    return await router.membership.switch_role(wid, P, drain_timeout_s=drain_s)


@pytest.mark.parametrize("how", ["retire", "switch"])
@pytest.mark.parametrize("fault", ["lost", "sigterm"])
def test_a_shrink_is_given_up_when_the_other_decode_worker_goes(how: str, fault: str) -> None:
    """1P+2D with streams on both decode workers; d0 starts draining to leave the decode pool,
    then d1 is lost (or told to drain by SIGTERM). The change is given up at once (not after
    the drain): d0 takes requests again, a lost d1's streams move to it, and new requests are
    served rather than refused "no healthy decode worker"."""

    async def main() -> None:
        router, ws = cluster([("p0", P), ("d0", D), ("d1", D)], policy="round_robin")
        admitted, tasks = await start(router, 4)
        answer(ws)
        on_d0, on_d1 = held_by(admitted, "d0"), held_by(admitted, "d1")
        assert on_d0 and on_d1
        pending = asyncio.create_task(change(router, how, "d0", drain_s=30.0))
        await settle()
        assert not ws["d0"].handle.routable
        d1 = ws["d1"].handle
        if fault == "lost":
            await lose(router, ws["d1"])
        else:
            d1.report(replace(d1.load, health=WorkerHealth.DRAINING))
            router.membership.on_pool_change(d1)
        done = await asyncio.wait_for(pending, 1.0)
        assert done == PoolChange("d0", done=False, why_not="no other decode worker takes requests")
        assert ws["d0"].handle.routable and ws["d0"].handle.role is D and "d0" in router.workers
        await settle()
        answer(ws)
        moved = on_d1 if fault == "lost" else []
        assert all(not a.stream.done for a in admitted)
        assert {a.stream.decode_worker for a in on_d0 + moved} == {"d0"}
        assert all(a.stream.migrations == 1 for a in moved)
        fresh = router.admit(GenerateInput([1, 2, 3], GREEDY, request_id="after"))
        assert fresh.decision.decode_worker == "d0"
        router.discard(fresh)
        if fault == "lost":
            del ws["d1"]
        await end_all(router, ws, admitted, tasks)

    asyncio.run(main())


def test_a_shrink_with_another_decode_worker_left_goes_on() -> None:
    """The check does not give up changes that leave a worker to decode: 1P+3D, d0 retired
    while d2 is lost; d1 takes what both held and d0 is retired."""

    async def main() -> None:
        router, ws = cluster([("p0", P), ("d0", D), ("d1", D), ("d2", D)], policy="round_robin")
        admitted, tasks = await start(router, 6)
        answer(ws)
        on_d0 = len(held_by(admitted, "d0"))
        pending = asyncio.create_task(router.membership.retire("d0", drain_timeout_s=0.2))
        await settle()
        await lose(router, ws["d2"])
        result = await asyncio.wait_for(pending, 2.0)
        assert result.done and result.moved == on_d0 > 0
        assert "d0" not in router.workers
        await settle()
        answer(ws)
        assert {a.stream.decode_worker for a in admitted} == {"d1"}
        for wid in ("d0", "d2"):
            del ws[wid]
        await end_all(router, ws, admitted, tasks)

    asyncio.run(main())


def test_planned_moves_do_not_use_up_the_migration_limit() -> None:
    """With ``--migration-limit 1``, a stream moved by two retirements whose drain ran out still
    moves after a worker is lost; the fault after that is the one the limit refuses."""

    async def main() -> None:
        roles = [(f"c{i}", COL) for i in range(5)]
        router, ws = cluster(roles, colocated=True, policy="round_robin", migration_limit=1)
        [a], tasks = await start(router, 1)
        answer(ws)
        s = a.stream
        for _ in range(2):  # planned: the drain runs out and the stream moves on
            was = s.decode_worker
            result = await router.membership.retire(was, drain_timeout_s=0.05)
            assert result.done and result.moved == 1
            del ws[was]
            await settle()
            answer(ws)
            assert s.decode_worker != was and not s.done
        assert (s.migrations, s.fault_migrations) == (2, 0)
        await lose(router, ws[s.decode_worker])  # a fault: the first the limit allows
        await settle()
        answer(ws)
        assert not s.done and (s.migrations, s.fault_migrations) == (3, 1)
        await lose(router, ws[s.decode_worker])
        await settle()
        assert s.done and s.error is not None
        assert "moved 1 times after faults (--migration-limit 1)" in s.error.message
        await asyncio.gather(*tasks)
        await settle()
        assert not any(router.request_state().values()), router.request_state()

    asyncio.run(main())


def test_a_switch_that_moved_requests_reports_them() -> None:
    """``switch_role`` returns what happened: done, with the streams its drain left moved."""

    async def main() -> None:
        router, ws = cluster([("p0", P), ("d0", D), ("d1", D)], policy="round_robin")
        admitted, tasks = await start(router, 4)
        answer(ws)
        on_d0 = held_by(admitted, "d0")
        switch_calls: list[Any] = []

        class Switches:
            async def control(self, msg: Any, timeout_s: float | None = None) -> Any:
                switch_calls.append(msg)
                return replace(ws["d0"].handle.info, role=msg.role, address="")

            def kill(self) -> None:
                pass

        ws["d0"].handle.caller = Switches()
        result = await router.membership.switch_role("d0", P, drain_timeout_s=0.05)
        assert result == PoolChange("d0", done=True, moved=len(on_d0)) and not result.clean
        assert switch_calls == [SwitchRole(P)] and ws["d0"].handle.role is P
        await settle()
        answer(ws)
        assert {a.stream.decode_worker for a in admitted} == {"d1"}
        await end_all(router, ws, admitted, tasks)

    asyncio.run(main())
