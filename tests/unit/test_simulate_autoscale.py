"""``pdserve simulate --autoscale``: the planner resizes the simulated pools through a 4x load
step and back, with every request served, every worker's blocks back, and fewer GPU-seconds
than holding the peak's layout all along."""

from __future__ import annotations

import argparse

import pytest

from pdserve.planning.simulate import add_simulate_args, simulate

STEP = (
    "--random-input-len 2048 --random-output-len 128 --random-range-ratio 0.5 --request-rate 8 "
    "--rate-curve 0:1,40:4,100:4,140:1 --duration 180 --prefill 1 --decode 1 --autoscale "
    "--autoscale-interval 5 --worker-start-s 2 --goodput ttft:250 tpot:100"
)


def run(flags: str) -> dict[str, object]:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    return simulate(p.parse_args(flags.split()))


def test_a_load_step_grows_the_pools_and_the_quiet_shrinks_them() -> None:
    m = run(STEP)
    assert m["completed"] == m["num_prompts"] and not any(m["errors"])  # type: ignore[arg-type]
    a = m["autoscale"]
    assert isinstance(a, dict)
    layouts = a["layouts"]
    peak = max(p + d for _, p, d in layouts)
    assert peak >= 3  # the step needed more than 1P+1D
    assert (layouts[-1][1], layouts[-1][2]) == (1, 1)  # back at the minimum once the load fell
    assert m["slo_attainment"] >= 0.9  # type: ignore[operator]
    static_peak = peak * layouts[-1][0]
    assert a["worker_seconds"] < 0.9 * static_peak  # type: ignore[operator]  # the peak is most of the run
    ups = [r for r in a["reasons"] if r[1] in ("scale_up", "overloaded", "switch")]
    assert ups and ups[0][0] <= 60  # within a few intervals of the step at 40 s
    # the report counts every request once, whatever layout it arrived under (the planner judges
    # a layout only by what arrived under it)
    assert sum(n for _, _, n in a["attainment_by_interval"]) == m["completed"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "extra, match",
    [("--colocated 2", "not with --colocated"), ("--goodput ttft:250", "both targets")],
)
def test_autoscale_refuses_what_it_cannot_plan(extra: str, match: str) -> None:
    flags = "--num-prompts 10 --request-rate 5 --autoscale " + extra
    with pytest.raises(ValueError, match=match):
        run(flags)
