"""The router and the simulator run one request flow (``pdserve.router.lifecycle``): the same
scripted scenarios, driven through the asyncio router (scripted workers answering as a worker
does) and through the simulator (the real role engines on its clock), send the same typed
commands to the same workers, in the same order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.router.dispatchers import make_dispatcher
from pdserve.router.lifecycle import Send
from pdserve.router.service import GenerateInput
from pdserve.simulator.calibration import load_sim_profile
from pdserve.simulator.cluster import Cluster
from pdserve.simulator.sim_request import SimRequest
from pdserve.simulator.sim_worker import SimWorker
from pdserve.worker import commands as C
from pdserve.worker.messages import KVTarget, TokenDelta, WorkerRole
from tests.unit.test_router_migration import Worker, cluster, consume, lose, settle

PROMPT = tuple(range(3, 35))
OUTPUT = 4
SCENARIOS = ("plain", "lost_transfer", "decode_lost", "abort_at_first_token")

# A command as both sides name it: (worker, command type, which request attempt, tokens resent)
Step = tuple[str, str, int, int]


def normalized(sent: list[Send], names: dict[str, str]) -> list[Step]:
    """Worker ids as role and index, request ids as their order of first appearance (the router
    mints random ones, the simulator its own)."""
    ids: dict[str, int] = {}
    out = []
    for s in sent:
        cmd = s.command
        rid = cmd.work.request_id if hasattr(cmd, "work") else cmd.request_id  # type: ignore[union-attr]
        resent = len(cmd.work.output_token_ids) if hasattr(cmd, "work") else 0  # type: ignore[union-attr]
        out.append((names[s.worker], type(cmd).__name__, ids.setdefault(rid, len(ids)), resent))
    return out


# -- through the router, against workers that answer as a worker does ----------------------------
def answer_all(ws: dict[str, Worker]) -> int:
    n = 0
    for w in ws.values():
        for call_id, cmd in w.commands():
            n += 1
            value: Any = None
            if isinstance(cmd, C.QueueReservation):
                value = True
            elif isinstance(cmd, C.AwaitReservation):
                value = KVTarget(f"kv-{cmd.request_id}", "127.0.0.1:1", ("tcp",), (0, 1, 2))
            elif not isinstance(cmd, (C.Prefill, C.AddLocal)):
                value = True
            w.answer(call_id, value)
    return n


async def pump(ws: dict[str, Worker]) -> None:
    """Answer until the router sends nothing more."""
    while True:
        await settle()
        if not answer_all(ws):
            return


def via_router(scenario: str) -> tuple[list[Step], list[Any]]:
    async def main() -> tuple[list[Step], list[Any]]:
        roles = [("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE), ("d1", WorkerRole.DECODE)]
        router, ws = cluster(roles[: 3 if scenario == "decode_lost" else 2], policy="round_robin")
        sent: list[Send] = []
        router.flow.on_send = sent.append
        params = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
        admitted = router.admit(GenerateInput(list(PROMPT), params))
        events: list[Any] = []
        task = asyncio.create_task(consume(router, admitted, events))
        stream = admitted.stream
        await pump(ws)
        p, d = ws["p0"], ws["d0"]

        def emit(w: Worker, *deltas: TokenDelta) -> None:
            router.flow.on_deltas(w.handle, deltas)

        emit(p, TokenDelta(stream.request_id, (1,), prefilled=True))
        if scenario == "abort_at_first_token":
            await router.abort(stream.client_id)
        await pump(ws)
        if scenario == "lost_transfer":
            emit(p, TokenDelta(stream.request_id, (), kv_lost=True))
            await pump(ws)
        emit(d, TokenDelta(stream.request_id, (1,)), TokenDelta(stream.request_id, (1,)))
        if scenario == "decode_lost":
            await lose(router, d)
            await pump(ws)
            d = ws[stream.decode_worker]
            emit(d, TokenDelta(stream.request_id, (1,), finished=True, finish_reason="length"))
        else:
            emit(d, TokenDelta(stream.request_id, (1,), finished=True, finish_reason="length"))
        await pump(ws)
        await task
        assert not any(router.request_state().values()), router.request_state()
        return normalized(sent, {"p0": "P0", "d0": "D0", "d1": "D1"}), events

    return asyncio.run(main())


# -- through the simulator -----------------------------------------------------------------------
def via_simulator(scenario: str) -> tuple[list[Step], SimRequest]:
    profile = load_sim_profile("h100-llama3-8b")
    dispatcher = make_dispatcher("round_robin", profile, 16)
    cfg = SchedulerConfig()
    decoders = 2 if scenario == "decode_lost" else 1
    c = Cluster(profile, 1, decoders, 0, dispatcher, cfg, cfg, 16, fast_steps=False)
    sent: list[Send] = []
    c.on_send = sent.append
    sr = c.submit(0.0, "r0", PROMPT, OUTPUT)
    deliver = c._deliver

    def watch(req: SimRequest, w: SimWorker, delta: TokenDelta) -> None:
        deliver(req, w, delta)
        at: Callable[[Callable[[], None]], None] = lambda fn: c.clock.at(c.clock.now, fn)  # noqa: E731
        if scenario == "abort_at_first_token" and w.role is WorkerRole.PREFILL:
            at(lambda: c.abort(req))
        if scenario == "decode_lost" and len(req.token_times) == 3 and w is c.by_id["decode-1"]:
            at(lambda: c.lose(w))

    c._deliver = watch  # type: ignore[method-assign]
    if scenario == "lost_transfer":
        start = c.link.start

        def fail_soon(tid: str, sender: Any, receiver: str, at: float) -> None:
            start(tid, sender, receiver, at)
            c.clock.at(at + 1e-9, lambda: c.link.cancel(tid))

        c.link.start = fail_soon  # type: ignore[method-assign]
    c.run()
    names = {"prefill-0": "P0", "decode-1": "D0", "decode-2": "D1"}
    return normalized(sent, names), sr


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_router_and_simulator_send_the_same_commands(scenario: str) -> None:
    router, events = via_router(scenario)
    sim, sr = via_simulator(scenario)
    assert router == sim
    assert sr.done
    if scenario == "abort_at_first_token":
        assert events[-1].finish_reason == "abort" and sr.error.startswith("CANCELLED")
    else:
        assert events[-1].usage.completion_tokens == OUTPUT == len(sr.token_times) and not sr.error


def test_the_scenarios_cover_the_flow() -> None:
    """Each scenario takes the path it names (so the comparison above compares something)."""
    seqs = {s: via_simulator(s)[0] for s in SCENARIOS}
    kinds = {s: [k for _, k, _, _ in seq] for s, seq in seqs.items()}
    assert kinds["plain"] == ["Prefill", "QueueReservation", "AwaitReservation", "SetTarget", "Start"]
    assert "KvLost" in kinds["lost_transfer"]
    assert ("D1", "AddLocal", 1, 3) in seqs["decode_lost"]  # moved, with the 3 tokens sent
    assert kinds["abort_at_first_token"][-2:] == ["Abort", "Abort"]
