"""The request-level model (``pdserve simulate --fluid``): the workload it replays is
``pdserve bench``'s own, every run ends with nothing held, its deadlines and admission act as
the router's, the planner resizes its pools, and its attainment tracks the event simulator's."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.bench.runner import build_workload
from pdserve.bench.workload import RateCurve
from pdserve.planning.fluid import FluidCluster
from pdserve.planning.fluid_data import Arrivals, Ended, FluidConfig, Role, ticks
from pdserve.planning.fluid_run import FluidAutoscaler, simulate_fluid, trace_arrivals, warp
from pdserve.planning.planner import Planner
from pdserve.planning.planner_data import Layout, PlannerConfig, moves
from pdserve.planning.sim_autoscale import AutoscaleConfig
from pdserve.planning.simulate import add_simulate_args, simulate
from pdserve.router.workload_window import light_means, prompt_quantile
from pdserve.simulator.calibration import load_sim_profile
from pdserve.simulator.run import workload

TRACE = Path(__file__).resolve().parents[3] / "shared/data/traces/AzureLLMInferenceTrace_conv_2023.csv"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="the shared Azure trace is not here")


def parse(flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_simulate_args(p)
    return p.parse_args(flags.split())


def fluid(flags: str) -> dict[str, object]:
    args = parse(flags + " --fluid")
    return simulate_fluid(args, None if args.trace else workload(args))


@given(
    st.lists(st.tuples(st.floats(1, 500), st.floats(0.05, 20)), min_size=1, max_size=6),
    st.lists(st.floats(0, 5000), min_size=1, max_size=30),
)
def test_warp_on_arrays_is_the_rate_curves_warp(points: list[tuple[float, float]], taus: list[float]) -> None:
    pts = [(0.0, points[0][1])]
    for dt, x in points[1:]:
        pts.append((pts[-1][0] + dt, x))
    curve = RateCurve(pts)
    got = warp(curve, np.array(taus))
    want = [curve.warp(t) for t in taus]
    assert np.allclose(got, want, rtol=1e-9, atol=1e-6)


@needs_trace
def test_trace_arrivals_are_the_bench_replay() -> None:
    """Laps of the trace, the mean rate and the curve: the arrays equal ``pdserve bench``'s
    requests (the trace has 19,366 rows: 25,000 requests from row 19,000 wrap around)."""
    ns = argparse.Namespace(
        seed=0,
        num_prompts=25_000,
        duration=0.0,
        dataset_name="trace",
        dataset_path=TRACE,
        time_scale=1.0,
        trace_start=19_000,
        rate_curve="0:1,300:3,900:1",
        request_rate=40.0,
        burstiness=1.0,
        random_input_len=1,
        random_output_len=1,
        random_range_ratio=0.0,
        vocab_size=32000,
        block_size=64,
    )
    specs = build_workload(ns)
    chunks = list(trace_arrivals(TRACE, 40.0, 25_000, 19_000, RateCurve.parse("0:1,300:3,900:1")))
    t = np.concatenate([c.t for c in chunks])
    assert np.allclose(t, [s.arrival_s for s in specs], rtol=1e-12, atol=1e-6)
    assert np.concatenate([c.prompt for c in chunks]).tolist() == [s.prompt_len for s in specs]
    assert np.concatenate([c.output for c in chunks]).tolist() == [s.output_len for s in specs]


@given(
    st.lists(st.floats(0, 50, allow_nan=False), max_size=200),
    st.integers(1, 5),
    st.sampled_from([0.1, 0.5, 2.0]),
)
@settings(max_examples=50)
def test_ticks_hand_every_arrival_over_once_in_its_tick(times: list[float], parts: int, tick: float) -> None:
    t = np.sort(np.array(times, dtype=np.float64))
    chunks = [
        Arrivals(c, np.arange(len(c), dtype=np.int64), np.ones(len(c), dtype=np.int64))
        for c in np.array_split(t, parts)
    ]
    seen = []
    for end, batch, more in ticks(chunks, tick):
        assert np.all(batch.t < end) and np.all(batch.t >= end - tick - 1e-12)
        seen.extend(batch.t.tolist())
        if not more:
            break
    assert seen == t.tolist()


@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9), st.integers(1, 9))
def test_moves_reach_the_target_switching_first(p0: int, d0: int, p1: int, d1: int) -> None:
    switched, (dp, dd) = moves(Layout(p0, d0), Layout(p1, d1))
    assert (p0 + switched + dp, d0 - switched + dd) == (p1, d1)
    up, down = max(0, p1 - p0), max(0, d1 - d0)
    assert abs(switched) == min(up, max(0, d0 - d1)) + min(down, max(0, p0 - p1))
    # nothing is started in one pool while the other stops a worker that could have switched
    assert not (dp > 0 and dd < 0) and not (dp < 0 and dd > 0)


def arrivals(rows: list[tuple[float, int, int]]) -> list[Arrivals]:
    t, p, o = zip(*rows, strict=True) if rows else ((), (), ())
    return [Arrivals(np.array(t, dtype=np.float64), np.array(p, dtype=np.int64), np.array(o, dtype=np.int64))]


def drive(cluster: FluidCluster, chunks: list[Arrivals], until: float = 0.0) -> list[Ended]:
    """Ticks until every request ended (and at least ``until``); the requests that ended."""
    ended: list[Ended] = []
    for t1, batch, more in ticks(chunks, cluster.config.tick_s):
        if t1 <= cluster.now:
            continue
        cluster.tick(t1, batch)
        cluster.settle(1.0)
        ended.extend(cluster.take_ended())
        if not more and not cluster.busy and t1 >= until:
            return ended
        assert t1 < 10_000, "the model did not drain"
    raise AssertionError("unreachable")


def test_hostile_lengths_end_with_nothing_held() -> None:
    """One-token outputs (their first token is their last), prompts longer than a step,
    arrivals at the same instant: every request ends, nothing is left anywhere."""
    model = load_sim_profile("h100-llama3-8b")
    rows = [(0.0, 1, 1), (0.0, 20_000, 2), (0.0, 9000, 1), (0.01, 5, 300), (0.01, 5, 300), (3.0, 100_000, 50)]
    c = FluidCluster(model, 1, 1, FluidConfig(ttft_s=0.25, tpot_s=0.1, step_tokens=8192))
    drive(c, arrivals(rows))
    assert c.offered == c.ended == len(rows)
    assert not any(c.request_state().values()), c.request_state()


def _steady_70s(
    prefill: int, retire_at: float | None = None
) -> tuple[FluidCluster, Planner, FluidAutoscaler, list[tuple[float, int, int]]]:
    """``prefill``P+1D under 20 requests a second for 70 s, the autoscaler recording what
    ends (deciding nothing); a prefill worker retired at ``retire_at``."""
    model = load_sim_profile("h100-llama3-8b")
    c = FluidCluster(model, prefill, 1, FluidConfig(ttft_s=0.25, tpot_s=0.1))
    planner = Planner(model, PlannerConfig(0.25, 0.1, shed=0.08))
    scaler = FluidAutoscaler(c, planner, AutoscaleConfig(interval_s=10.0))
    rows = [(0.05 * i, 100 * (i % 20 + 1), 20) for i in range(1400)]
    for t1, batch, _ in ticks(arrivals(rows), c.config.tick_s):
        if t1 > 70.0:
            break
        if retire_at is not None and c.now < retire_at <= t1:
            c.retire(c.idlest(Role.PREFILL))
        c.tick(t1, batch)
        c.settle(1.0)
        scaler.record(c.take_ended())
    return c, planner, scaler, rows


def test_the_planners_window_reads_the_arrivals_and_their_prompt_tail() -> None:
    """The fluid autoscaler's observation: the window's arrival rate, mean lengths and prompt
    length at the planner's quantile (as the router's window gives them), and an arrival log
    trimmed to what a window can read."""
    c, planner, scaler, rows = _steady_70s(prefill=1)
    obs = scaler.observe(70.0, 10.0)
    window = [p for t, p, _ in rows if 60.0 < t < 70.0 - 1e-9]
    assert obs.load.rate == pytest.approx(20.0, rel=0.05)
    assert obs.load.prompt_tokens == pytest.approx(np.mean(window), rel=0.02)
    assert obs.load.prompt_tail_tokens == prompt_quantile(window, 0.9) == 1900.0  # not the longest
    # the lightest shares' means, as the router's window measures them
    assert [a for a, _ in obs.load.light] == list(planner.config.shares) == [0.98, 0.96, 0.94, 0.92]
    for (_, got), (_, want) in zip(
        obs.load.light, light_means(sorted(window), planner.config.shares), strict=True
    ):
        assert got == pytest.approx(want, rel=0.02) and got < obs.load.prompt_tokens
    # older ticks trimmed, and the longest window read (the decode pool's: the intervals
    # remembered) still whole
    longest = planner.memory.decode_span(10.0, 10.0, 1e9)
    assert longest == 30.0 and 70.0 - longest - 1.0 - c.config.tick_s <= c.arrival_log[0][0] <= 70.0 - longest
    assert scaler.observe(70.0, longest).load.rate == pytest.approx(20.0, rel=0.05)


def test_the_planner_judges_a_layout_by_what_arrived_under_it() -> None:
    """A window's attainment sample is the requests that arrived once the serving workers took
    their present form; every request that ended is still counted for the SLO (``served``)."""
    c, _, scaler, _ = _steady_70s(prefill=2, retire_at=60.0)
    assert 60.0 - c.config.tick_s <= c.layout_since <= 60.0  # retired at the tick before 60 s
    obs = scaler.observe(70.0, 20.0)
    end = np.concatenate([e.end for e in scaler.ends])
    arrival = np.concatenate([e.arrival for e in scaler.ends])
    good = np.concatenate([e.good for e in scaler.ends])
    window = (end > 50.0) & (end <= 70.0)
    fresh = window & (arrival >= c.layout_since)
    assert 0 < obs.requests == int(fresh.sum()) < obs.served[0] == int(window.sum())
    assert obs.attainment == pytest.approx(good[fresh].mean())
    assert obs.served[1] == pytest.approx(good[window].mean())


def test_a_full_kv_pool_fails_reservations_at_the_routers_deadline() -> None:
    """Decode KV for about one request: the rest wait for room, and those still waiting after
    the deadline fail (RESOURCE_EXHAUSTED, a miss); all state is released."""
    model = load_sim_profile("h100-llama3-8b")

    class Tiny:  # the same times, a KV pool of 2,000 tokens
        def __getattr__(self, name: str) -> object:
            return getattr(model, name)

        kv_capacity_tokens = 2000

    rows = [(0.001 * i, 1000, 900) for i in range(20)]
    cfg = FluidConfig(ttft_s=1.0, tpot_s=1.0, reserve_timeout_s=5.0)
    c = FluidCluster(Tiny(), 1, 1, cfg)  # type: ignore[arg-type]
    ended = drive(c, arrivals(rows))
    # the first decodes for about 6 s: every other one is still waiting at its deadline
    assert (c.failed, c.good, c.ended) == (19, 1, 20)
    end = np.concatenate([e.end for e in ended])
    failed = np.isnan(np.concatenate([e.ttft for e in ended]))
    assert np.allclose(np.sort(end[failed]), [0.001 * i + 5.0 for i in range(1, 20)])
    assert not any(c.request_state().values()), c.request_state()


def test_admission_refuses_what_would_miss() -> None:
    """A burst twenty times what one prefill worker clears within the TTFT target: with
    ``reject`` most of it is refused and the admitted requests meet the target; without, they
    queue and miss."""
    model = load_sim_profile("h100-llama3-8b")
    rows = [(0.0005 * i, 2000, 20) for i in range(400)]
    kept = FluidCluster(model, 1, 1, FluidConfig(ttft_s=0.25, tpot_s=0.1, reject=True))
    drive(kept, arrivals(rows))
    queued = FluidCluster(model, 1, 1, FluidConfig(ttft_s=0.25, tpot_s=0.1))
    drive(queued, arrivals(rows))
    assert kept.rejected > 300 and queued.rejected == 0
    assert kept.good >= 0.8 * (len(rows) - kept.rejected)
    assert queued.good < 30


def test_a_switched_or_retired_worker_takes_no_new_work_and_stops_when_done() -> None:
    """A prefill worker switched to decode is never again given a prompt (its old place in
    the prefill queue is void) and serves decode ``switch_s`` after it drained; a retired
    worker's GPU is held until its retirement, not only until its last step."""
    model = load_sim_profile("h100-llama3-8b")
    c = FluidCluster(model, 3, 1, FluidConfig(tick_s=0.5))
    drive(c, arrivals([(0.1, 500, 4)]), until=100.0)
    switched, retired = c.pool(Role.PREFILL)[:2]
    c.retire(switched, switch_to=Role.DECODE)
    c.retire(retired)
    rows = [(100.0 + 0.01 * i, 700, 30) for i in range(300)]
    drive(c, [Arrivals(*(np.array(x) for x in zip(*rows, strict=True)))])
    assert switched.role is Role.DECODE and switched.routable and not switched.members
    assert retired.stopped_at >= 100.0
    assert c.counts() == (1, 2)
    assert c.ended == c.offered == 301 and not any(c.request_state().values())
    assert c.worker_seconds(c.now) == pytest.approx(4 * c.now - (c.now - retired.stopped_at))


@needs_trace
@pytest.mark.parametrize("layout, rate", [("1 1", 20), ("2 2", 45)])
def test_attainment_tracks_the_event_simulator(layout: str, rate: int) -> None:
    """A minute of the Azure trace on the same layout, profile and SLO: the fluid model's
    attainment within 5 points of the event simulator's (its documented check is
    ``benchmarks/autoscale_day.py``)."""
    p, d = layout.split()
    flags = (
        f"--trace {TRACE} --request-rate {rate} --duration 60 --prefill {p} --decode {d} "
        "--goodput ttft:250 tpot:100 --policy goodput --admission reject --no-local-prefill"
    )
    e = simulate(parse(flags))
    f = fluid(flags)
    assert f["num_prompts"] == e["num_prompts"]
    assert abs(f["slo_attainment"] - e["slo_attainment"]) <= 0.05, (f["slo_attainment"], e["slo_attainment"])  # type: ignore[operator]


def test_the_planner_grows_the_pools_through_a_step_and_shrinks_them_after() -> None:
    m = fluid(
        "--random-input-len 2048 --random-output-len 128 --random-range-ratio 0.5 --request-rate 8 "
        "--rate-curve 0:1,40:4,100:4,140:1 --duration 240 --prefill 1 --decode 1 --autoscale "
        "--autoscale-interval 5 --worker-start-s 2 --goodput ttft:250 tpot:100"
    )
    a = m["autoscale"]
    assert isinstance(a, dict)
    peak = max(p + d for _, p, d in a["layouts"])
    assert peak >= 3
    assert (a["layouts"][-1][1], a["layouts"][-1][2]) == (1, 1)
    assert m["slo_attainment"] >= 0.85  # type: ignore[operator]
    assert a["worker_seconds"] < 0.9 * peak * m["duration"]  # type: ignore[operator]


@needs_trace
def test_spending_the_error_budget_holds_a_trough_on_fewer_workers() -> None:
    """``--autoscale-spend`` end to end (flags, simulator, planner): the step workload of
    ``benchmarks/autoscale.py``, whose trough after the peak the pools serve at 86-90 % a window
    on 1P+1D — held there with the budget, grown without it — at no cost to the run's 90 %."""
    flags = (
        f"--trace {TRACE} --request-rate 20 --rate-curve 0:1,200:1,210:4,450:4,460:1 --duration 900 "
        "--goodput ttft:250 tpot:100 --policy goodput --admission reject --no-local-prefill "
        "--prefill 1 --decode 1 --autoscale --max-prefill 8 --max-decode 6"
    )
    strict, spent = fluid(flags), fluid(flags + " --autoscale-spend 0.5")
    a, b = strict["autoscale"], spent["autoscale"]
    assert isinstance(a, dict) and isinstance(b, dict)
    assert b["worker_seconds"] < 0.95 * a["worker_seconds"]
    assert spent["slo_attainment"] >= 0.9 and strict["slo_attainment"] >= 0.9  # type: ignore[operator]
    grown = [r[0] for r in a["reasons"] if r[1] == "scale_up" and r[0] > 600]  # in the trough
    assert grown and not [r for r in b["reasons"] if r[1] == "scale_up" and r[0] > 600]


@pytest.mark.parametrize(
    "extra, match",
    [("--colocated 2", "not with --colocated"), ("--autoscale --goodput ttft:250", "both targets")],
)
def test_fluid_refuses_what_it_cannot_model(extra: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fluid("--num-prompts 10 --request-rate 5 " + extra)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(tick_s=0.0),
        dict(tick_s=math.nan),
        dict(reserve_timeout_s=0.0),
        dict(ttft_s=-1.0),
        dict(max_seqs=0),
    ],
)
def test_absurd_settings_are_refused(cfg: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FluidConfig(**cfg)  # type: ignore[arg-type]


def test_each_hour_counts_its_arrivals_attainment_and_workers_held() -> None:
    """``by_hour`` adds up to the run: every request in the hour it arrived, the run's
    attainment as their weighted mean, the misses in the hour whose load caused them, and the
    worker-hours held (two workers all along)."""
    m = fluid(
        "--random-input-len 8192 --random-output-len 64 --request-rate 0.25 "
        "--rate-curve 0:1,3600:1,3601:6,7200:6,7201:1 --duration 9000 "
        "--prefill 1 --decode 1 --goodput ttft:400 tpot:100"
    )
    rows = m["by_hour"]
    assert isinstance(rows, list) and [r["hour"] for r in rows] == list(range(len(rows)))
    assert len(rows) == math.ceil(m["duration"] / 3600)  # type: ignore[operator]
    assert sum(r["requests"] for r in rows) == m["num_prompts"]
    good = sum(r["requests"] * r["attainment"] for r in rows if r["requests"])
    assert good / m["num_prompts"] == pytest.approx(m["slo_attainment"], abs=1e-3)  # type: ignore[operator]
    assert m["slo_attainment"] < 0.95  # type: ignore[operator]
    busy = rows[1]["attainment"]  # the hour at six times the rate
    assert busy < 0.95 and all(r["attainment"] > busy + 0.05 for r in (rows[0], rows[2])), rows
    assert [r["worker_hours"] for r in rows[:2]] == [2.0, 2.0]
    assert sum(r["worker_hours"] for r in rows) == pytest.approx(m["worker_seconds"] / 3600, abs=0.02)  # type: ignore[operator]
