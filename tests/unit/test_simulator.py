"""The cluster simulator: queueing theory where it applies, conservation everywhere."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from model_runtime.latency import H100_LLAMA3_8B as P
from pdserve.bench.workload import RequestSpec, arrival_times
from simulator.run import add_simulate_args, simulate


def args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    return p.parse_args(list(flags))


def test_one_prefill_instance_is_an_md1_queue() -> None:
    """Uniform 2,048-token prompts, one at a time, Poisson arrivals: mean TTFT must match the
    M/D/1 formula D + R·D² / (2(1 − R·D))."""
    n, rate, prompt = 4000, 10.0, 2048
    d = P.prefill_time(prompt)
    rng = random.Random(3)
    specs = [
        RequestSpec(t, tuple(rng.randrange(32000) for _ in range(8)) * (prompt // 8), prompt, 1)
        for t in arrival_times(n, rate, 1.0, rng)
    ]
    a = args(
        "--prefill", "1", "--decode", "1", "--max-num-batched-tokens", str(prompt), "--max-num-seqs", "1"
    )
    m = simulate(a, specs)
    expected = d + rate * d * d / (2 * (1 - rate * d))
    assert m["completed"] == n
    assert m["mean_ttft_ms"] / 1000 == pytest.approx(expected, rel=0.06)


@pytest.mark.parametrize("layout", [("--prefill", "2", "--decode", "2"), ("--colocated", "3")])
def test_every_request_finishes_with_its_length(layout: tuple[str, ...]) -> None:
    lengths = ["--random-input-len", "700", "--random-output-len", "60", "--random-range-ratio", "0.9"]
    slo = ["--goodput", "ttft:250", "tpot:100"]
    a = args(*layout, "--num-prompts", "400", "--request-rate", "40", *lengths, *slo)
    m = simulate(a)
    assert m["completed"] == 400 and m["failed"] == 0
    assert all(o >= 1 for o in m["output_lens"])
    assert m["total_output_tokens"] == sum(m["output_lens"])
    assert 0.0 <= m["slo_attainment"] <= 1.0


def test_decode_memory_pressure_preempts_and_still_finishes() -> None:
    """A decode pool far too small for the load: requests wait for reservations (and may be
    preempted and recomputed), and all of them still finish with every token; the run's own
    leak check (every pool empty at the end) passes."""
    import dataclasses

    from model_runtime.latency import PROFILES

    small = dataclasses.replace(
        P, name="tiny-memory", memory_bytes=P.weight_bytes + 40 * 1024 * P.kv_bytes_per_token
    )
    PROFILES[small.name] = small
    try:
        lengths = ["--random-input-len", "3000", "--random-output-len", "400"]
        a = args("--prefill", "1", "--decode", "1", "--profile", small.name, "--num-prompts", "60",
                 "--request-rate", "200", *lengths)  # fmt: skip
        m = simulate(a)
        assert m["completed"] == 60 and m["total_output_tokens"] == 60 * 400
    finally:
        del PROFILES[small.name]


def test_plan_tries_colocated_and_every_split_and_recommends_the_best(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from simulator.plan import add_plan_args, candidates, cmd_plan

    c = candidates(4)
    assert sum(1 for x in c if x.colocated == 4) == 3
    assert {(x.prefill, x.decode) for x in c if not x.colocated} == {(1, 3), (2, 2), (3, 1)}
    assert all(x.gpus == 4 for x in c)
    assert len({(x.prefill, x.decode) for x in candidates(64, max_splits=16) if not x.colocated}) <= 21
    p = argparse.ArgumentParser()
    add_plan_args(p)
    lengths = ["--random-input-len", "500", "--random-output-len", "40"]
    slo = ["--goodput", "ttft:250", "tpot:100"]
    a = p.parse_args(["--gpus", "2", "--num-prompts", "60", *lengths, *slo, "--sweep-steps", "2"])
    assert cmd_plan(a) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "per GPU" in ln and "goodput" in ln]
    best = max(float(ln.split()[-3]) for ln in lines)
    assert f"{best:.3f} req/s per GPU" in out.split("recommended:")[1]
    assert "pdserve serve" in out and "--slo default:ttft=250,tpot=100" in out
    # the conditional family: goodput routing on 2 colocated and on the 1P+1D split
    assert "2 colocated conditional" in out and "1P+1D conditional" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["conditional_over_better_pure"] > 0
    pp = next(c for c in candidates(4, priority_budgets=(2048,)) if c.family == "prefill-priority")
    flags = pp.serve_flags("h100-llama3-8b", "least_loaded", "default:ttft=250")
    assert "--colocated 4 --colocated-schedule prefill-priority --max-num-batched-tokens 2048" in flags
    for flag in (["--no-local-prefill"], ["--decode-max-num-batched-tokens", "512"]):  # set per candidate
        bad = p.parse_args(["--gpus", "2", *lengths, *slo, *flag])
        assert cmd_plan(bad) == 2
        assert "chosen per candidate" in capsys.readouterr().err
