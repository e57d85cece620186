"""``pdserve serve`` flags reach the engines they configure (no workers started)."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.deploy.pools import PoolSpec
from pdserve.model_runtime.scheduler.plan import ColocatedSchedule
from pdserve.planning.planner_data import Bounds
from pdserve.serve import build, planner_config


def _spec(*flags: str) -> PoolSpec:
    return build(build_parser().parse_args(["serve", "--model", "tiny", "--device", "cpu", *flags]))[0]


def test_colocated_schedule_defaults_to_chunked_and_can_be_prefill_priority() -> None:
    assert _spec("--colocated", "2").engine.scheduler.colocated is ColocatedSchedule.CHUNKED
    spec = _spec(
        "--colocated", "2", "--colocated-schedule", "prefill-priority", "--max-num-batched-tokens", "2048"
    )
    assert spec.colocated == 2
    assert spec.engine.scheduler.colocated is ColocatedSchedule.PREFILL_PRIORITY
    assert spec.engine.scheduler.max_num_batched_tokens == 2048


def test_the_readme_synopsis_lists_every_serve_flag() -> None:
    """The README's `pdserve serve` synopsis is the reference users read: no flag missing, none
    that the command does not take."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("pdserve serve [", 1)[1].split("```", 1)[0]
    documented = set(re.findall(r"--[a-z0-9-]+", block))
    serve = next(
        a for a in build_parser()._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
        if a.prog.endswith(" serve")
    )  # fmt: skip
    flags = {s for action in serve._actions for s in action.option_strings if s.startswith("--")} - {"--help"}
    assert documented == flags, (sorted(flags - documented), sorted(documented - flags))


def test_autoscale_settings_are_checked_before_anything_starts() -> None:
    base = ["serve", "--model", "tiny", "--device", "cpu", "--autoscale", "--slo", "chat:ttft=250,tpot=50"]

    def plan(*flags: str):  # type: ignore[no-untyped-def]
        args = build_parser().parse_args([*base, *flags])
        return planner_config(args, *build(args))

    p = plan("--min-prefill", "2", "--max-prefill", "4")
    assert p is not None and p.bounds == Bounds(2, 4, 1, 8) and (p.ttft_s, p.tpot_s) == (0.25, 0.05)
    assert p.max_seqs == 64  # the CPU engines' cap, as they resolve it
    assert plan("--max-num-seqs", "16").max_seqs == 16  # type: ignore[union-attr]
    assert plan("--compute", "emulated:h100-llama3-8b").max_seqs == 256  # type: ignore[union-attr]
    assert p.shed == 0.0  # the class admits every request: nothing is refused to count on
    base[-1] = "chat:ttft=250,tpot=50,admission=reject"
    p = plan()
    assert p is not None and p.shed == pytest.approx(0.08) and plan("--autoscale-shed", "0").shed == 0.0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="shed"):
        plan("--autoscale-shed", "0.1")  # all the misses the SLO allows: none left for the served
    base[-1] = "chat:ttft=250,tpot=50"
    with pytest.raises(ValueError, match="admission reject"):
        plan("--autoscale-shed", "0.05")
    with pytest.raises(ValueError, match="shed must be"):
        plan("--autoscale-shed", "-1")  # out of range says so first
    for flags, match in (
        (["--autoscale-interval", "0"], "autoscale-interval"),
        (["--autoscale-interval", "nan"], "autoscale-interval"),
        (["--autoscale-start-wait", "0"], "autoscale-start-wait"),
        (["--autoscale-start-wait", "inf"], "autoscale-start-wait"),
        (["--autoscale-start-wait", "nan"], "autoscale-start-wait"),
        (["--min-decode", "0"], "pool bounds"),
        (["--min-prefill", "3", "--max-prefill", "2"], "pool bounds"),
        (["--colocated", "2"], "not with --colocated"),
    ):
        with pytest.raises(ValueError, match=match):
            plan(*flags)
    args = build_parser().parse_args(["serve", "--model", "tiny", "--device", "cpu", "--autoscale"])
    with pytest.raises(ValueError, match="both targets"):
        planner_config(args, *build(args))


def test_gpu_workers_get_gpu_sized_defaults_and_cpu_workers_keep_theirs() -> None:
    cpu = _spec()
    assert cpu.engine.scheduler.max_num_batched_tokens == 512 and cpu.engine.scheduler.max_num_seqs == 64
    assert cpu.engine.cache.memory_budget_bytes == 0  # 256 MiB, resolved by the worker
    gpu = build(build_parser().parse_args(["serve", "--model", "tiny", "--gpus-per-worker", "1"]))[0]
    assert gpu.gpus_per_worker == 1 and gpu.engine.device == "cuda"
    assert gpu.engine.scheduler.max_num_batched_tokens == 8192 and gpu.engine.scheduler.max_num_seqs == 256
    assert gpu.engine.cache.memory_budget_bytes == 0  # what the weights leave free on the device
    pinned = _spec("--max-num-batched-tokens", "1024", "--kv-cache-mib", "64")
    assert pinned.engine.scheduler.max_num_batched_tokens == 1024
    assert pinned.engine.cache.memory_budget_bytes == 64 << 20


def test_emulated_gpu_workers_batch_as_gpus_do() -> None:
    """Their steps take a GPU's time and their KV pool is a GPU's: a CPU's 64-request cap held a
    decode worker far below what its pool holds, and requests queued a minute for a slot."""
    emu = _spec("--compute", "emulated:h100-llama3-8b")
    assert emu.engine.scheduler.max_num_batched_tokens == 8192 and emu.engine.scheduler.max_num_seqs == 256
    pinned = _spec("--compute", "emulated:h100-llama3-8b", "--max-num-seqs", "32")
    assert pinned.engine.scheduler.max_num_seqs == 32


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--http-port", "70000"),
        ("--grpc-port", "-1"),
        ("--drain-timeout", "nan"),
        ("--drain-timeout", "-5"),
        ("--drain-timeout", "inf"),
        ("--liveness-timeout", "nan"),
        ("--liveness-timeout", "0"),
        ("--liveness-timeout", "1e-40"),
        ("--liveness-timeout", "inf"),
    ],
)
def test_absurd_router_settings_are_refused_by_name(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "tiny", flag, value])
    assert f"argument {flag}: must be" in capsys.readouterr().err
