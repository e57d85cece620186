"""Run-time membership against scripted workers (no processes): a worker joins only if it
serves the deployment's model, a draining worker gets no new requests but keeps its commands,
and the pool keeper replaces a lost worker, backing off while starts fail."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from pdserve.deploy.keeper import PoolKeeper
from pdserve.router.service import GenerateInput
from pdserve.router.workers import WorkerHandle
from pdserve.worker import commands as C
from pdserve.worker.messages import WorkerHealth, WorkerRole
from tests.unit.test_router_migration import GREEDY, Worker, cluster, lose, settle

P, D = WorkerRole.PREFILL, WorkerRole.DECODE


def test_a_worker_joins_only_with_the_deployments_model_shape() -> None:
    router, _ = cluster([("prefill-0", P), ("decode-0", D)])
    fresh = Worker("decode-1", D).handle
    for field, value in (("vocab_size", 999), ("block_size", 32), ("dtype", "bfloat16"), ("kv_blocks", 8)):
        odd = WorkerHandle(replace(fresh.info, **{field: value}), fresh.caller)
        with pytest.raises(ValueError, match=field):
            router.membership.add_worker(odd)
    with pytest.raises(ValueError, match="colocated"):
        router.membership.add_worker(Worker("colocated-0", WorkerRole.COLOCATED).handle)
    with pytest.raises(ValueError, match="already registered"):
        router.membership.add_worker(Worker("decode-0", D).handle)
    router.membership.add_worker(fresh)
    assert router.workers["decode-1"] is fresh


def test_a_draining_worker_gets_no_new_request_but_keeps_its_commands() -> None:
    async def main() -> None:
        router, ws = cluster([("colocated-0", WorkerRole.COLOCATED), ("colocated-1", WorkerRole.COLOCATED)],
                             colocated=True)  # fmt: skip
        held = router.admit(GenerateInput([5, 6, 7], GREEDY))
        victim = ws[held.decision.decode_worker]
        other = next(w for w in ws.values() if w is not victim)
        events = router.run(held)
        task = asyncio.ensure_future(events.__anext__())
        await settle()
        victim.handle.report(replace(victim.handle.load, health=WorkerHealth.DRAINING))
        assert not victim.handle.routable and victim.handle.alive
        for _ in range(4):
            decision = router.admit(GenerateInput([1, 2], GREEDY)).decision
            assert decision.decode_worker == other.handle.worker_id
        [(call_id, add)] = victim.commands()
        assert isinstance(add, C.AddLocal)
        victim.answer(call_id, None)
        await router.abort(held.stream.client_id)
        await asyncio.wait_for(task, 1)
        await events.aclose()
        await settle()
        # The client's abort still reaches the draining worker.
        assert any(isinstance(c, C.Abort) for _, c in victim.commands())
        # A report that it is healthy again (a drain called off) makes it routable again; a lost
        # worker stays lost whatever it reported last.
        victim.handle.report(replace(victim.handle.load, health=WorkerHealth.HEALTHY))
        assert victim.handle.routable
        victim.handle.mark_lost()
        victim.handle.report(replace(victim.handle.load, health=WorkerHealth.HEALTHY))
        assert not victim.handle.alive

    asyncio.run(main())


def one_prefill_two_decode() -> tuple[Any, dict[str, Worker], FakeOutputs]:
    """1P+2D scripted workers, with the keeper's stand-in for the router's outputs."""
    router, ws = cluster([("prefill-0", P), ("decode-0", D), ("decode-1", D)])
    outputs = FakeOutputs()
    router.outputs = outputs  # type: ignore[assignment]
    return router, ws, outputs


class FakeOutputs:
    def __init__(self) -> None:
        self.expected: list[str] = []
        self.forgotten: list[str] = []

    def expect(self, wid: str) -> None:
        self.expected.append(wid)

    def forget(self, wid: str) -> None:
        self.forgotten.append(wid)

    def registered(self, wid: str) -> None:
        pass

    async def wait_connected(self, wids: list[str], timeout_s: float) -> None:
        pass


def test_the_keeper_replaces_a_lost_worker_and_backs_off_while_starts_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        router, ws, outputs = one_prefill_two_decode()
        attempts: list[str] = []
        killed: list[str] = []
        joined: list[WorkerHandle] = []

        async def launch(role: WorkerRole, wid: str) -> WorkerHandle:
            attempts.append(wid)
            w = Worker(wid, role)
            w.handle.caller.kill = lambda: killed.append(wid)  # type: ignore[method-assign]
            if len(attempts) == 1:
                raise RuntimeError("no room")
            if len(attempts) == 2:  # starts, then is not what the deployment serves
                return WorkerHandle(replace(w.handle.info, block_size=64), w.handle.caller)
            return w.handle

        sleeps: list[float] = []
        real_sleep = asyncio.sleep

        async def fast_sleep(s: float) -> None:
            sleeps.append(s)
            await real_sleep(0)

        monkeypatch.setattr("pdserve.deploy.keeper.asyncio.sleep", fast_sleep)
        keeper = PoolKeeper(router, outputs, launch, {P: 1, D: 2}, joined.append)  # type: ignore[arg-type]
        await lose(router, ws["decode-0"])
        for _ in range(50):
            if joined:
                break
            await real_sleep(0.01)
        assert attempts == ["decode-2", "decode-3", "decode-4"]
        assert sleeps == [1.0, 2.0] and keeper.failed_starts == 2 and keeper.replaced == 1
        assert killed == ["decode-3"]  # the one that started but could not join is stopped
        assert outputs.expected == attempts and {"decode-2", "decode-3"} <= set(outputs.forgotten)
        assert [h.worker_id for h in joined] == ["decode-4"]
        assert set(router.workers) == {"prefill-0", "decode-1", "decode-4"}  # decode-0's place taken
        assert keeper.pending == 0
        await keeper.close()

    asyncio.run(main())


def test_closing_the_keeper_stops_a_start_under_way() -> None:
    async def main() -> None:
        router, ws = cluster([("prefill-0", P), ("decode-0", D)])
        outputs = FakeOutputs()
        router.outputs = outputs  # type: ignore[assignment]
        started = asyncio.Event()

        async def launch(role: WorkerRole, wid: str) -> Any:
            started.set()
            await asyncio.sleep(3600)

        keeper = PoolKeeper(router, outputs, launch, {P: 1, D: 1}, lambda h: None)  # type: ignore[arg-type]
        await lose(router, ws["prefill-0"])
        await asyncio.wait_for(started.wait(), 1)
        assert keeper.pending == 1
        await asyncio.wait_for(keeper.close(), 1)
        assert keeper.pending == 0 and "prefill-1" not in router.workers

    asyncio.run(main())


def test_a_retired_worker_is_not_replaced() -> None:
    async def main() -> None:
        router, ws, outputs = one_prefill_two_decode()
        launched: list[str] = []

        async def launch(role: WorkerRole, wid: str) -> WorkerHandle:
            launched.append(wid)
            return Worker(wid, role).handle

        PoolKeeper(router, outputs, launch, {P: 1, D: 2}, lambda h: None)  # type: ignore[arg-type]
        assert (await router.membership.retire("decode-0", drain_timeout_s=1.0)).clean  # nothing in flight
        assert "decode-0" not in router.workers and not ws["decode-0"].handle.alive
        with pytest.raises(ValueError, match="no live worker"):
            await router.membership.retire("decode-0", drain_timeout_s=1.0)
        await settle()
        assert launched == []  # a scale-down is not a loss

    asyncio.run(main())


def test_a_sigterm_drain_of_the_only_decode_worker_surges_its_replacement_first() -> None:
    """1P+1D, the decode worker drains after SIGTERM: its replacement starts at once; new
    requests still go to it (not refused) until the replacement's channel is up; then it is
    sent ``Release`` and new requests go to the replacement; its exit starts no second one."""

    async def main() -> None:
        router, ws = cluster([("prefill-0", P), ("decode-0", D)])
        outputs = FakeOutputs()
        router.outputs = outputs  # type: ignore[assignment]
        launched: list[str] = []
        gate = asyncio.Event()
        channels: dict[str, Any] = {}

        async def launch(role: WorkerRole, wid: str) -> WorkerHandle:
            launched.append(wid)
            await gate.wait()  # the replacement's start-up
            ws[wid] = Worker(wid, role)
            channels[wid], ws[wid].handle.channel = ws[wid].handle.channel, None  # connects later
            return ws[wid].handle

        keeper = PoolKeeper(router, outputs, launch, {P: 1, D: 1}, lambda h: None)  # type: ignore[arg-type]
        old = ws["decode-0"]
        old.handle.report(replace(old.handle.load, health=WorkerHealth.DRAINING))
        router.membership.on_pool_change(old.handle)
        await settle()
        assert launched == ["decode-1"]  # at once, before it has left
        for _ in range(3):  # while it is the last decode worker: served there, not refused
            admitted = router.admit(GenerateInput([1, 2, 3], GREEDY))
            assert admitted.decision.decode_worker == "decode-0"
            router.discard(admitted)
        assert router.ready and not [c for _, c in old.commands() if isinstance(c, C.Release)]
        gate.set()
        await settle()
        new = ws["decode-1"]
        new.handle.channel = channels["decode-1"]
        router.membership.on_pool_change(new.handle)  # its channel is up
        await settle()
        releases = [(i, c) for i, c in old.commands() if isinstance(c, C.Release)]
        assert len(releases) == 1 and old.handle.released
        old.answer(releases[0][0], True)
        assert router.admit(GenerateInput([1, 2, 3], GREEDY)).decision.decode_worker == "decode-1"
        await lose(router, old)  # it exits
        await settle()
        assert launched == ["decode-1"] and "decode-0" not in router.workers
        assert not keeper._surged and keeper.pending == 0
        await keeper.close()

    asyncio.run(main())


def test_a_draining_worker_with_another_in_its_pool_is_released_at_once() -> None:
    """1P+2D: SIGTERM to decode-0 starts its replacement and releases it at once (decode-1 takes
    requests), so new requests go to decode-1 and its drain ends when its own are done."""

    async def main() -> None:
        router, ws, outputs = one_prefill_two_decode()
        launched: list[str] = []

        async def launch(role: WorkerRole, wid: str) -> WorkerHandle:
            launched.append(wid)
            await asyncio.sleep(3600)
            raise AssertionError

        keeper = PoolKeeper(router, outputs, launch, {P: 1, D: 2}, lambda h: None)  # type: ignore[arg-type]
        old = ws["decode-0"].handle
        old.report(replace(old.load, health=WorkerHealth.DRAINING))
        router.membership.on_pool_change(old)
        await settle()
        assert launched == ["decode-2"] and old.released
        assert [type(c) for _, c in ws["decode-0"].commands()] == [C.Release]
        assert router.admit(GenerateInput([1, 2, 3], GREEDY)).decision.decode_worker == "decode-1"
        await keeper.close()

    asyncio.run(main())
