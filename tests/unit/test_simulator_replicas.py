"""Router replicas in the simulator (``pdserve simulate --routers N``): each its own dispatcher,
seeing the others' work only in the workers' load reports."""

from __future__ import annotations

import argparse

import pytest

from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.planning.simulate import add_simulate_args, simulate
from pdserve.simulator.cluster import Cluster
from pdserve.simulator.replicas import HEARTBEAT_S, WorkerReports
from pdserve.simulator.run import Simulation
from pdserve.simulator.sim_worker import SimWorker
from pdserve.worker.commands import Prefill, QueueReservation
from pdserve.worker.messages import PlacedWork, WorkerLoad, WorkerRole, WorkItem

WORK = [
    "--policy", "goodput", "--goodput", "ttft:250", "tpot:100", "--num-prompts", "300",
    "--request-rate", "60", "--random-input-len", "1500", "--random-output-len", "120",
    "--random-range-ratio", "0.8", "--decode-max-num-batched-tokens", "2048",
]  # fmt: skip


def args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    return p.parse_args(list(flags))


def test_one_router_is_the_simulator_without_replicas() -> None:
    """``--routers 1`` (the default) runs no replica machinery: the same run, to the bit."""
    plain = simulate(args("--prefill", "2", "--decode", "3", *WORK))
    one = simulate(args("--prefill", "2", "--decode", "3", *WORK, "--routers", "1"))
    for m in (plain, one):
        m.pop("simulation_wall_s")
    assert plain == one and one["routers"] == 1
    sim = Simulation.build(args("--prefill", "2", "--decode", "3", *WORK))
    assert all(w.reports is None for w in sim.cluster.by_id.values())


def truth(c: Cluster, w: SimWorker, replica: int) -> PlacedWork:
    """The work ``replica``'s live requests hold on ``w``, from the requests themselves."""
    out = [0] * 5
    for sr in c.requests.values():
        a = sr.attempt
        if sr.replica != replica or a is None or sr.done:
            continue
        sent, prompt = len(sr.work.output_token_ids), len(sr.work.prompt_token_ids)
        first_out = len(sr.token_times) > sent
        local = sr.prefill_worker is None
        if not first_out and (sr.prefill_worker is w or (local and sr.decode_worker is w)):
            out[0] += 1
            out[1] += prompt + sent
        if sr.decode_worker is w:
            left = sr.work.params.max_tokens - sent
            out[2] += 1
            out[3] += prompt + sent + left // 2
            # decode counts the first token a prefill worker sampled once it is told (Start)
            out[4] += (
                sr.work.params.max_tokens
                - len(sr.token_times)
                + (not local and first_out and not a.start_sent)
            )
    return PlacedWork(*out)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("lose", [False, True])
def test_every_workers_accounts_hold_exactly_each_replicas_requests(fast: bool, lose: bool) -> None:
    """Three replicas: at every moment checked, each worker's owners' accounts (fed only with
    the commands it ran and the deltas its engine emitted, as a worker process's are) hold what
    each replica's live requests hold there; a lost decode worker's requests move (each
    staying with its replica) and the accounts follow."""
    flags = ["--prefill", "2", "--decode", "3", *WORK, "--routers", "3"]
    sim = Simulation.build(args(*flags, *([] if fast else ["--no-fast-steps"])))
    c = sim.cluster
    checked = [0, 0]  # checks, and accounts seen holding work

    def check() -> None:
        for w in c.by_id.values():
            if w.lost:
                continue
            assert w.reports is not None
            for r in range(3):
                placed = w.reports.owners.placed(r)
                assert placed == truth(c, w, r), (c.clock.now, w.wid, r)
                checked[1] += placed != PlacedWork()
        checked[0] += 1
        if c.requests or c.clock.now < 5.0:
            c.clock.at(c.clock.now + 0.013, check)

    c.clock.at(0.0, check)
    if lose:
        c.clock.at(2.0, lambda: c.lose(c.decoders[0]))
    sim.run()  # (its own end check: no worker's accounts hold work)
    assert checked[0] > 300 and checked[1] > 1000
    assert {sr.replica for sr in sim.tracked} == {0, 1, 2}
    assert all(sr.done and not sr.error for sr in sim.tracked)
    assert all(len(d.ledger) == 0 for d in c.dispatchers)  # type: ignore[attr-defined]


def test_a_replica_hears_of_the_others_only_when_the_worker_reports() -> None:
    reports = WorkerReports(2)
    load = WorkerLoad("p0", WorkerRole.PREFILL, "", 0, 0, 100, 100, 0)
    reports.before(1, Prefill(WorkItem("a", tuple(range(40)), SamplingParams(max_tokens=8))))
    # replica 0 looks while the worker steps: it has not reported since
    assert reports.load_for(0, load, now=0.1, stepping=True).others == PlacedWork()
    reports.report(now=0.2)  # the step ends
    assert reports.load_for(0, load, now=0.2, stepping=True).others == PlacedWork(1, 40)
    assert reports.load_for(1, load, now=0.2, stepping=True).others == PlacedWork()  # its own
    reports.owners.forget("a")  # gone while the worker idles: heard at its next heartbeat
    assert reports.load_for(0, load, now=0.2 + HEARTBEAT_S / 2, stepping=False).others == PlacedWork(1, 40)
    assert reports.load_for(0, load, now=0.21 + HEARTBEAT_S, stepping=False).others == PlacedWork()


def test_replicas_need_one_router_at_least() -> None:
    with pytest.raises(ValueError, match="routers"):
        simulate(args("--prefill", "1", "--decode", "1", "--num-prompts", "4", "--routers", "0"))


def test_the_fluid_model_refuses_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.planning.simulate import cmd_simulate

    assert cmd_simulate(args("--prefill", "1", "--decode", "1", "--fluid", "--routers", "2")) == 2
    assert "--fluid models one router" in capsys.readouterr().err


def test_a_decode_run_reports_the_tokens_of_its_steps_ended_so_far() -> None:
    """A decode run's tokens reach the owners' accounts only when delivered (when someone
    looks); a report mid-run counts the steps ended so far for every row."""
    reports = WorkerReports(3)
    for owner, rid in ((0, "a"), (1, "b"), (1, "c")):
        work = WorkItem(rid, tuple(range(10)), SamplingParams(max_tokens=50))
        reports.before(owner, QueueReservation(work, f"kv-{rid}", 1.0))
    reports.start_run(["a", "b", "c"])
    reports.report(now=1.0, undelivered=4)
    assert [seen.decode_remaining for seen in reports.heard] == [100 - 8, 50 - 4, 150 - 12]
    for rid in ("a", "b", "c"):  # delivered: the accounts have them, and nothing is counted twice
        reports.tokens(rid, 4, finished=False)
    reports.report(now=1.1)
    assert [seen.decode_remaining for seen in reports.heard] == [100 - 8, 50 - 4, 150 - 12]
