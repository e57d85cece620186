"""Step-time variability: the quantile grid, the copula sampler's marginals and correlation,
the fit from a sequence of ratios, and the simulator drawing from a profile that has it."""

from __future__ import annotations

import argparse
import math
import random
import statistics

import pytest

from pdserve.planning.simulate import add_simulate_args, simulate
from pdserve.simulator.calibration import Calibrated, HostCalibration, load_sim_profile
from pdserve.simulator.jitter import (
    GRID,
    StepJitter,
    fit_jitter,
    lag1_correlation,
    normal_scores,
    quantile_grid,
)
from pdserve.steptime.fitted import FittedProfile

CPU = FittedProfile("cpu", 0.02, 7e-4, 2e-7, 0.011, 4e-6, 8e-4, 3e-4, 2e10, 24576, 20000, 4096)
SKEW = (0.8, 0.9, 0.95, 1.0, 1.1, 1.3, 2.0)  # a right-skewed scatter, median 1


def test_quantile_grid_is_median_one_from_minimum_to_maximum() -> None:
    g = quantile_grid([2.0, 4.0, 3.0, 5.0, 1.0], points=5)
    assert g == pytest.approx((1 / 3, 2 / 3, 1.0, 4 / 3, 5 / 3))
    with pytest.raises(ValueError):
        quantile_grid([1.0])
    with pytest.raises(ValueError):
        quantile_grid([1.0, 0.0])


def test_normal_scores_and_lag1_correlation() -> None:
    z = normal_scores([3.0, 1.0, 2.0])
    assert z[1] < z[2] < z[0] and z[2] == pytest.approx(0.0)
    assert lag1_correlation([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) > 0.4
    assert lag1_correlation([1.0, -1.0] * 10) < -0.8
    assert lag1_correlation([1.0, 1.0, 1.0]) == 0.0


def draws(rho: float, n: int, seed: int = 1) -> list[float]:
    j = StepJitter(SKEW, SKEW, rho, random.Random(seed))
    return [j.factor(i % 3 == 0) for i in range(n)]


def test_draws_follow_the_grid_whatever_the_correlation() -> None:
    for rho in (0.0, 0.8):
        xs = sorted(draws(rho, 30_000))
        assert statistics.median(xs) == pytest.approx(1.0, abs=0.02)
        assert xs[0] >= SKEW[0] and xs[-1] <= SKEW[-1]
        # probability 5/6 of the grid is 1.3
        assert xs[int(5 / 6 * len(xs))] == pytest.approx(1.3, abs=0.04)
    assert lag1_correlation(normal_scores(draws(0.0, 20_000))) == pytest.approx(0.0, abs=0.03)
    assert lag1_correlation(normal_scores(draws(0.8, 20_000))) == pytest.approx(0.8, abs=0.03)


def test_same_seed_same_draws_and_no_grid_no_variability() -> None:
    assert draws(0.5, 50, seed=7) == draws(0.5, 50, seed=7)
    assert draws(0.5, 50, seed=7) != draws(0.5, 50, seed=8)
    flat = StepJitter((), SKEW, 0.5, random.Random(0))
    assert [flat.factor(True) for _ in range(5)] == [1.0] * 5
    with pytest.raises(ValueError):
        StepJitter(SKEW, SKEW, 1.0, random.Random(0))
    with pytest.raises(ValueError):
        StepJitter((1.2, 1.0), SKEW, 0.0, random.Random(0))


def test_fit_recovers_what_the_sampler_drew() -> None:
    j = StepJitter(SKEW, (0.9, 1.0, 1.2), 0.6, random.Random(3))
    seq = []
    for i in range(20_000):
        kind = i % 10 == 0
        seq.append((kind, j.factor(kind)))
    pj, dj, rho = fit_jitter([seq], points=7)
    assert pj == pytest.approx(SKEW, abs=0.06)
    assert dj[0] == pytest.approx(0.9, abs=0.01) and dj[-1] == pytest.approx(1.2, abs=0.01)
    assert rho == pytest.approx(0.6, abs=0.05)
    few = fit_jitter([[(True, 1.0)] * 5 + [(False, 1.1)] * 30])
    assert few[0] == () and len(few[1]) == GRID


def test_draws_from_a_fitted_grid_keep_the_measured_tail() -> None:
    """A fitted grid's ends are the extreme steps logged: the sampler must not spread more than
    a sliver of its draws towards them (the 99th percentile and the mean stay the measured)."""
    rng = random.Random(5)
    measured = [math.exp(rng.gauss(0.0, 0.06)) * (1.75 if rng.random() < 0.002 else 1.0) for _ in range(3000)]
    grid_p, grid_d, _ = fit_jitter([[(False, r) for r in measured]])
    j = StepJitter(grid_p, grid_d, 0.0, random.Random(6))
    drawn = sorted(j.factor(False) for _ in range(30_000))
    med = statistics.median(measured)
    emp = sorted(r / med for r in measured)
    assert drawn[int(0.99 * len(drawn))] == pytest.approx(emp[int(0.99 * len(emp))], rel=0.03)
    assert statistics.fmean(drawn) == pytest.approx(statistics.fmean(emp), rel=0.01)


def sim(profile: str, seed: int) -> dict[str, object]:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    flags = "--prefill 1 --decode 1 --num-prompts 200 --request-rate 0.5 --random-input-len 256"
    flags += f" --random-output-len 32 --profile {profile} --jitter-seed {seed} --goodput ttft:400 tpot:20"
    return simulate(p.parse_args(flags.split()))


def test_the_simulator_draws_each_step_from_the_profile(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plain, flat, skewed = tmp_path / "plain.json", tmp_path / "flat.json", tmp_path / "skewed.json"
    plain.write_text(CPU.to_json())
    flat.write_text(
        Calibrated(CPU, HostCalibration(prefill_jitter=(1.0, 1.0), decode_jitter=(1.0, 1.0))).to_json()
    )
    skewed.write_text(
        Calibrated(CPU, HostCalibration(prefill_jitter=SKEW, decode_jitter=SKEW, jitter_corr=0.6)).to_json()
    )
    loaded = load_sim_profile(str(skewed))
    assert (
        isinstance(loaded, Calibrated) and loaded.calibration.prefill_jitter == SKEW
    )  # lists back to tuples
    base = sim(str(plain), 0)
    assert sim(str(flat), 3)["ttfts"] == base["ttfts"]  # a flat grid is the deterministic model
    a, b = sim(str(skewed), 0), sim(str(skewed), 1)
    assert a["completed"] == 200 and a == {**sim(str(skewed), 0), "simulation_wall_s": a["simulation_wall_s"]}
    assert a["ttfts"] != b["ttfts"]
    # at low load a scatter of median 1 leaves the median TTFT (one step) and lengthens its tail
    assert statistics.median(a["ttfts"]) == pytest.approx(statistics.median(base["ttfts"]), rel=0.1)  # type: ignore[arg-type]
    assert a["p99_ttft_ms"] > base["p99_ttft_ms"]  # type: ignore[operator]


def test_a_profile_refuses_a_grid_that_is_not_one() -> None:
    with pytest.raises(ValueError, match="decode_jitter"):
        HostCalibration(decode_jitter=(1.0,))
    with pytest.raises(ValueError, match="jitter_corr"):
        HostCalibration(jitter_corr=-0.1)
