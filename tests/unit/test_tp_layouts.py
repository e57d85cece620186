"""Workers of a tensor-parallel degree: the flags, the simulated pools, the emulated engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.deploy.pools import PoolSpec
from pdserve.flags import layout_label
from pdserve.planning.simulate import add_simulate_args, cmd_simulate
from pdserve.simulator.run import Simulation
from pdserve.steptime.roofline import H100_LLAMA3_8B as P
from pdserve.steptime.roofline import H100_LLAMA3_70B as BIG


@pytest.mark.parametrize("command", ["serve", "simulate", "plan"])
@pytest.mark.parametrize("bad", ["0", "3", "16", "-2"])
def test_degrees_are_powers_of_two_up_to_eight(
    command: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--prefill-tp", "--decode-tp"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--gpus", "8", flag, bad])
        assert "power of two from 1 to 8" in capsys.readouterr().err


def test_serve_takes_each_pools_degree_into_its_pool_spec() -> None:
    from pdserve.serve import build

    base = ["serve", "--model", "tiny", "--device", "cpu"]
    spec = build(build_parser().parse_args([*base, "--prefill-tp", "2", "--decode-tp", "8"]))[0]
    assert (spec.prefill_tp, spec.decode_tp) == (2, 8)
    plain = build(build_parser().parse_args(base))[0]
    assert (plain.prefill_tp, plain.decode_tp) == (1, 1)
    with pytest.raises(ValueError, match="decode_tp must be one of 1, 2, 4, 8"):
        PoolSpec(decode_tp=3)
    # plan searches unless told: no degree by default
    plan = build_parser().parse_args(["plan", "--gpus", "8"])
    assert (plan.prefill_tp, plan.decode_tp) == (None, None)


def _args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    return p.parse_args(["--profile", "h100-llama3-70b", "--num-prompts", "12", "--random-input-len",
                         "300", "--random-output-len", "8", "--goodput", "ttft:250", "tpot:100",
                         *flags])  # fmt: skip


def test_each_pool_simulates_at_its_own_degree(capsys: pytest.CaptureFixture[str]) -> None:
    sim = Simulation.build(_args("--prefill", "2", "--decode", "3", "--prefill-tp", "2", "--decode-tp", "4"))
    c = sim.cluster
    assert sim.gpus == 2 * 2 + 3 * 4
    assert {w.profile.name for w in c.prefillers} == {"h100-llama3-70b@tp2"}
    assert {w.profile.name for w in c.decoders} == {"h100-llama3-70b@tp4"}
    assert c.decoders[0].kv.num_blocks == BIG.at_tp(4).kv_capacity_tokens // 64
    assert c.prefillers[0].kv.num_blocks == BIG.at_tp(2).kv_capacity_tokens // 64
    m = sim.run()
    assert m["layout"] == "2P@tp2+3D@tp4" and m["gpus"] == 16 and m["completed"] == 12
    # the router's predictor prices prompts on the prefill pool's degree, decode steps on decode's
    from pdserve.router.dispatchers import make_dispatcher

    d = make_dispatcher("goodput", BIG.at_tp(4), prefill_profile=BIG.at_tp(2))
    model = d.model  # type: ignore[attr-defined]
    assert model.prefill_s("p", 1000) == BIG.at_tp(2).prefill_time(1000)
    assert model.decode_step_s("d", 4, 4000) == BIG.at_tp(4).decode_time(4, 4000)
    # a 70B model on single GPUs is refused with the degrees it runs at
    assert cmd_simulate(_args("--decode-tp", "2")) == 2
    assert "does not fit at tp=1" in capsys.readouterr().err
    assert layout_label(0, 0, 4, 1, 8) == "4 colocated@tp8" and layout_label(3, 1, 0) == "3P+1D"


def test_emulated_engines_take_their_degrees_time_and_memory() -> None:
    from pdserve.model_runtime.config import EngineConfig
    from pdserve.model_runtime.engine.runtime import build_runtime

    rt = build_runtime(EngineConfig(model="tiny", device="cpu", compute="emulated:h100-llama3-70b@tp4"))
    four = BIG.at_tp(4)
    assert rt.runner.profile == four  # type: ignore[attr-defined]
    assert rt.kv.num_blocks == four.kv_capacity_tokens // rt.block_size
    with pytest.raises(ValueError, match="valid degrees: 2, 4, 8"):
        EngineConfig(model="tiny", compute="emulated:h100-llama3-70b")


def test_plan_chooses_each_pools_degree_where_a_mixed_one_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU with a quarter of an H100's FLOPs and a slow all-reduce: a 3,000-token prompt meets
    TTFT 250 ms only on two GPUs or more, a decode step meets TPOT 30 ms only on one (two
    all-reduces a layer at 0.5 ms each). No layout with one degree everywhere passes; the plan
    finds prefill at tp 2 beside decode at tp 1, and says what equal degrees reached."""
    from pdserve.planning.plan import add_plan_args, cmd_plan, degrees

    slow = dataclasses.replace(P, name="slow-link", peak_flops=P.peak_flops / 4, tp_link_latency_s=0.5e-3)
    assert slow.at_tp(1).prefill_time(3000) > 0.25 > slow.at_tp(2).prefill_time(3000)
    assert slow.at_tp(1).decode_time(8, 8 * 3100) < 0.03 < slow.at_tp(2).decode_time(8, 8 * 3100)
    path = tmp_path / "slow.json"
    path.write_text(slow.to_json())
    p = argparse.ArgumentParser()
    add_plan_args(p)
    base = ["--profile", str(path), "--gpus", "4", "--num-prompts", "30", "--random-input-len", "3000",
            "--random-output-len", "20", "--goodput", "ttft:250", "tpot:30", "--sweep-steps", "2",
            "--colocated-budgets", "4096", "--priority-budgets", "", "--prefill-budgets", "4096",
            "--no-conditional", "--jobs", "1"]  # fmt: skip
    assert cmd_plan(p.parse_args(base)) == 0
    out = capsys.readouterr().out
    s = json.loads(out.strip().splitlines()[-1])
    assert (s["recommended_prefill_tp"], s["recommended_decode_tp"]) == (2, 1)
    assert s["recommended"] == "1P@tp2+2D, budget 4096" and s["recommended_per_gpu"] > 0
    assert s["best_equal_tp_per_gpu"] == 0.0 and "best with equal TP everywhere" in out
    assert "--prefill-tp 2 --decode-tp 1" in out
    # a degree fixed by hand is not searched; one the model does not fit at is refused
    assert degrees(p.parse_args([*base, "--prefill-tp", "2"])) == ([2], [1, 2, 4])  # 4 GPUs: not 8
    big = ["--profile", "h100-llama3-70b", "--gpus", "8", "--goodput", "ttft:250", "tpot:100"]
    assert cmd_plan(p.parse_args([*big, "--decode-tp", "1"])) == 2
    assert "valid degrees 2, 4, 8" in capsys.readouterr().err


def test_layouts_at_other_degrees_hold_a_pools_gpus_within_the_budget() -> None:
    from pdserve.planning.plan_candidates import Candidate, candidates, splits, tp_neighbours

    assert splits(64, 16) == list(range(1, 64, 3))  # one GPU a worker: as before
    assert splits(64, 16, 2, 2) == list(range(1, 32, 2))  # about as many splits of two-GPU workers
    first = candidates(64, 16, (2048,), (), (8192,), prefill_tp=2, decode_tp=2)
    assert all(c.gpus <= 64 and (c.colocated == 32 or c.prefill + c.decode == 32) for c in first)
    best = Candidate(10, 22, 0, 8192, prefill_tp=2, decode_tp=2)  # 20 prefill GPUs, 44 decode
    near = tp_neighbours(best, 64, [(4, 2), (8, 2), (2, 8)])
    # each pair: the prefill pool's 20 GPUs held as near as its workers come, then the decode
    # pool's 44; the other pool takes what is left
    assert [(c.prefill, c.prefill_tp, c.decode, c.decode_tp) for c in near] == [
        (5, 4, 22, 2),  # 20 prefill GPUs; holding decode's gives the same layout
        (3, 8, 20, 2),  # 24 prefill GPUs (the nearest), 40 left for decode
        (2, 8, 22, 2),  # 44 decode GPUs held
        (10, 2, 5, 8),  # 20 prefill GPUs held: 40 left for decode
        (8, 2, 6, 8),  # 48 decode GPUs (the nearest to 44), 16 left for prefill
    ]
    assert all(c.gpus <= 64 and c.budget == 8192 for c in near)
    assert Candidate(0, 0, 8, 2048, decode_tp=8).gpus == 64
    assert Candidate(3, 2, 0, 2048, prefill_tp=4, decode_tp=8).gpus == 28
