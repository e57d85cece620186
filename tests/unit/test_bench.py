"""``pdserve bench``: metric arithmetic by hand, arrival processes, trace parsing, field names."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.bench.metrics import RequestResult, Slo, summarize
from pdserve.bench.sweep import run_search, search
from pdserve.bench.workload import (
    RequestSpec,
    WorkloadError,
    arrival_times,
    length_pairs_random,
    num_prompts,
    read_trace,
    trace_requests,
)

AZURE = Path(__file__).resolve().parents[2].parent / "shared/data/traces/AzureLLMInferenceTrace_conv_2023.csv"


def ok(ttft: float, itls: list[float], prompt: int = 10) -> RequestResult:
    return RequestResult(prompt, True, len(itls) + 1, ttft, itls, ttft + sum(itls))


def test_metrics_by_hand() -> None:
    results = [
        ok(0.100, [0.020, 0.040]),  # TPOT 30 ms, E2E 160 ms
        ok(0.300, []),  # one output token: TTFT and E2E only, no TPOT
        ok(0.050, [0.200]),  # TPOT 200 ms
        RequestResult(10, error="HTTP 500"),  # failed
        RequestResult(10, error="HTTP 429", rejected=True),  # rejected
    ]
    m = summarize(results, duration_s=2.0, slo=Slo(ttft_ms=250, tpot_ms=100))
    assert m["completed"] == 3 and m["failed"] == 2 and m["rejected"] == 1
    assert m["total_output_tokens"] == 3 + 1 + 2
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["median_tpot_ms"] == pytest.approx(115.0)  # (30 + 200) / 2: the 1-token request has none
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_itl_ms"] == pytest.approx(40.0)  # gaps 20, 40, 200
    assert m["p99_e2el_ms"] == pytest.approx(299.0)  # E2E 160, 250, 300: 250 + 0.98 * 50
    # Joint attainment over all five: only the first meets TTFT <= 250 and TPOT <= 100 (the
    # second misses TTFT, the third TPOT); failed and rejected are misses.
    assert m["slo_attainment"] == pytest.approx(1 / 5)
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["ttfts"][3] == 0.0 and m["errors"][3] == "HTTP 500"


def test_percentiles_interpolate_like_numpy() -> None:
    results = [ok(t / 1000, []) for t in (10, 20, 30, 40)]
    m = summarize(results, 1.0, Slo())
    assert m["median_ttft_ms"] == pytest.approx(25.0)
    assert m["p90_ttft_ms"] == pytest.approx(37.0)  # numpy.percentile([10,20,30,40], 90)
    assert m["p99_ttft_ms"] == pytest.approx(39.7)


def test_json_field_names_match_vllm_bench_serve() -> None:
    m = summarize([ok(0.1, [0.01])], 1.0, Slo(ttft_ms=100))
    names = [
        "duration",
        "completed",
        "failed",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "total_input_tokens",
        "total_output_tokens",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "errors",
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        names += [f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p99_{metric}_ms"]
    assert set(names) <= set(m), set(names) - set(m)
    json.dumps(m)  # serializable as --save-result writes it


def test_goodput_flag_parsing() -> None:
    assert Slo.parse(["ttft:250", "tpot:100"]) == Slo(250.0, 100.0, 0.0)
    for bad in (["ttft"], ["tbt:5"], ["ttft:fast"], ["tpot:0"], ["ttft:nan"], ["tpot:inf"], ["e2el:-inf"]):
        with pytest.raises(ValueError):
            Slo.parse(bad)


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_arrivals_have_the_asked_rate_and_burstiness(burstiness: float, cv: float) -> None:
    t = arrival_times(20000, rate=8.0, burstiness=burstiness, rng=random.Random(1))
    gaps = [b - a for a, b in zip([0.0, *t], t, strict=False)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 8.0, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.08)
    assert arrival_times(3, float("inf"), 1.0, random.Random(0)) == [0.0, 0.0, 0.0]
    for rate, shape in ((0.0, 1.0), (math.nan, 1.0), (8.0, math.nan), (8.0, math.inf), (-1.0, 1.0)):
        with pytest.raises(WorkloadError):
            arrival_times(3, rate, shape, random.Random(0))


def test_random_lengths_stay_in_range() -> None:
    pairs = length_pairs_random(500, 100, 20, 0.5, random.Random(0))
    assert all(50 <= i <= 150 and 10 <= o <= 30 for i, o in pairs)
    assert length_pairs_random(3, 7, 5, 0.0, random.Random(0)) == [(7, 5)] * 3
    for lens in ((0, 5), (7, 0), (-5, 5)):  # these were drawn as 1-token lengths, silently
        with pytest.raises(WorkloadError, match="must be >= 1"):
            length_pairs_random(3, *lens, 0.0, random.Random(0))


@pytest.mark.parametrize("duration", [math.nan, -1.0, math.inf])
def test_a_duration_that_is_no_number_of_seconds_is_refused(duration: float) -> None:
    args = argparse.Namespace(duration=duration, num_prompts=10, request_rate=5.0, rate_curve=None)
    with pytest.raises(WorkloadError, match="--duration"):
        num_prompts(args)
    none = argparse.Namespace(duration=0.0, num_prompts=10, request_rate=5.0, rate_curve=None)
    assert num_prompts(none) == 10


@pytest.mark.parametrize("scale", [math.nan, 0.0, -2.0])
def test_a_trace_replay_speed_must_be_positive(scale: float) -> None:
    with pytest.raises(WorkloadError, match="--time-scale"):
        trace_requests([], 1, scale, 256, 16, random.Random(0))


def test_jsonl_trace_with_hash_ids_shares_prefix_blocks(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 40, "output_length": 7, "hash_ids": [1, 2, 9]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = trace_requests(read_trace(p), 10, time_scale=2.0, vocab=256, block_size=16, rng=random.Random(0))
    assert [r.arrival_s for r in reqs] == [0.0, 0.25]
    a, b = reqs[0].prompt, reqs[1].prompt
    assert len(a) == len(b) == 40 and a[:32] == b[:32] and a[32:] != b[32:]
    p.write_text('{"timestamp": 0, "input_length": "many"}\n')
    with pytest.raises(WorkloadError, match=r"t\.jsonl:1"):
        read_trace(p)


def test_azure_trace_parses() -> None:
    if not AZURE.exists():
        pytest.skip(f"shared trace data not present at {AZURE}")
    rows = read_trace(AZURE)
    assert len(rows) == 19366 and rows[0].timestamp_s == 0.0
    assert rows[0].input_len == 374 and rows[0].output_len == 44
    assert 3400 < rows[-1].timestamp_s < 3600  # one hour


def test_sweep_brackets_then_bisects_to_the_capacity() -> None:
    """A fake server that meets the SLO below 7 req/s: the sweep lands within a step of 7."""
    import argparse
    import asyncio

    from pdserve.bench.sweep import sweep

    calls: list[float] = []
    seeds: list[int] = []

    async def point(rate: float, seed: int) -> dict[str, object]:
        calls.append(rate)
        seeds.append(seed)
        att = 1.0 if rate <= 7.0 else 0.5
        keys = ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms",
                "p99_tpot_ms", "request_goodput", "request_throughput")  # fmt: skip
        return {"slo_attainment": att, **dict.fromkeys(keys, 1.0)}

    args = argparse.Namespace(
        sweep_target=0.9, sweep_min_rate=1.0, sweep_max_doublings=10, sweep_steps=6, sweep_seeds=2, seed=0
    )
    res = asyncio.run(sweep(point, args))
    assert res["bracketed"] and 6.5 < res["goodput_rate"] <= 7.0
    assert calls[:8] == [1, 1, 2, 2, 4, 4, 8, 8]  # doubling, each rate for both seeds
    assert len(set(seeds)) == len(seeds)  # never the same prompts twice (the server's prefix cache)
    assert [p["rate"] for p in res["points"]] == sorted(p["rate"] for p in res["points"])


def test_trace_replayed_at_a_requested_mean_rate(tmp_path: Path) -> None:
    import argparse
    import math

    from pdserve.bench.runner import build_workload

    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i * 1000, "input_length": 8, "output_length": 2}) + "\n"
                         for i in range(11)))  # fmt: skip
    args = argparse.Namespace(
        seed=0, num_prompts=11, dataset_name="trace", dataset_path=p, time_scale=1.0, request_rate=5.0,
        vocab_size=256, block_size=16,
    )  # fmt: skip
    assert build_workload(args)[-1].arrival_s == pytest.approx(2.0)  # 1 req/s native, replayed at 5
    args.request_rate = math.inf
    assert build_workload(args)[-1].arrival_s == pytest.approx(10.0)  # the trace's own timing


def test_duration_scales_the_request_count_with_the_rate() -> None:
    import argparse

    from pdserve.bench.runner import num_prompts

    ns = argparse.Namespace(num_prompts=300, request_rate=100.0, duration=20.0)
    assert num_prompts(ns) == 2000
    assert num_prompts(argparse.Namespace(num_prompts=300, request_rate=5.0, duration=20.0)) == 300
    assert num_prompts(argparse.Namespace(num_prompts=300, request_rate=float("inf"), duration=20.0)) == 300
    assert num_prompts(argparse.Namespace(num_prompts=300, request_rate=100.0, duration=0.0)) == 300


def test_goodput_search_stops_early_and_reports_unbracketed_runs() -> None:
    from pdserve.bench.sweep import run_search, search

    measured: list[float] = []

    def measure(rate: float) -> float:
        measured.append(rate)
        return 1.0 if rate <= 10.0 else 0.0

    found = run_search(search(4.0, 10, 6), measure)
    assert measured[:3] == [4.0, 8.0, 16.0] and 9.5 < found.goodput <= 10.0
    assert found.bracketed and found.failed_at is not None and found.failed_at > 10.0 and not found.stopped

    measured.clear()
    stopped = run_search(search(4.0, 10, 6, stop=lambda hi, mid: hi <= 20.0), measure)
    assert measured == [4.0, 8.0, 16.0] and stopped.stopped  # the failing end cannot beat 20
    assert (stopped.goodput, stopped.failed_at) == (8.0, 16.0)

    never = run_search(search(1.0, 3, 6), lambda rate: 1.0)
    assert (never.goodput, never.failed_at, never.bracketed) == (4.0, None, False)


def test_short_trace_is_replayed_lap_after_lap(tmp_path: Path) -> None:
    """More requests than rows: the trace repeats at its own rate, each lap with fresh block
    hashes (a replay must not hit the prefix cache the first lap filled)."""
    import argparse

    from pdserve.bench.runner import build_workload
    from pdserve.bench.workload import loop_trace

    row = {"input_length": 32, "output_length": 2, "hash_ids": [7, 8]}
    rows = [{"timestamp": i * 1000, **row} for i in range(3)]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    looped = loop_trace(read_trace(p), 7)
    assert [r.timestamp_s for r in looped] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # one gap between laps
    assert [r.hash_ids for r in looped[::3]] == [(7, 8), (9, 10), (11, 12)]  # shifted past the range
    args = argparse.Namespace(
        seed=0, num_prompts=7, dataset_name="trace", dataset_path=p, time_scale=1.0, request_rate=2.0,
        vocab_size=256, block_size=16,
    )  # fmt: skip
    reqs = build_workload(args)
    assert len(reqs) == 7 and reqs[-1].arrival_s == pytest.approx(3.0)  # 1 req/s native, at 2
    assert reqs[0].prompt == reqs[1].prompt != reqs[3].prompt  # shared within a lap, not across


def test_trace_start_row_varies_a_replay_and_wraps_around(tmp_path: Path) -> None:
    """--trace-start picks the first row; past the end the trace wraps with fresh hashes, so
    different start rows give different workloads where a different --seed does not."""
    import argparse

    from pdserve.bench.runner import build_workload
    from pdserve.bench.workload import loop_trace

    lens = [10, 20, 30, 40]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i * 1000, "input_length": n, "output_length": 2,
                                     "hash_ids": [5 + i]}) + "\n" for i, n in enumerate(lens)))  # fmt: skip
    rows = read_trace(p)
    wrapped = loop_trace(rows, 3, start=2)
    assert [r.input_len for r in wrapped] == [30, 40, 10]
    assert [r.timestamp_s for r in wrapped] == [2.0, 3.0, 4.0] and wrapped[2].hash_ids == (9,)  # 5 + stride 4
    with pytest.raises(WorkloadError, match="outside"):
        loop_trace(rows, 3, start=4)

    def workload(start: int, seed: int) -> list[int]:
        args = argparse.Namespace(
            seed=seed, num_prompts=3, dataset_name="trace", dataset_path=p, time_scale=1.0,
            request_rate=float("inf"), vocab_size=256, block_size=16, trace_start=start,
        )  # fmt: skip
        return [r.prompt_len for r in build_workload(args)]

    assert workload(0, 0) == workload(0, 1) == [10, 20, 30]  # a seed leaves a trace's lengths alone
    assert workload(1, 0) == [20, 30, 40]


@given(
    st.floats(0.01, 5000, allow_nan=False),
    st.integers(0, 14),
    st.integers(0, 4),
    st.integers(1, 12),
)
def test_a_warm_started_search_finds_the_cold_searchs_bracket(
    threshold: float, first: int, steps: int, doublings: int
) -> None:
    """With attainment falling as the rate grows, entering the rate grid anywhere gives the
    bracket, and the goodput, that doubling from the bottom gives."""

    def measure(rate: float) -> float:
        return 1.0 if rate <= threshold else 0.5

    cold_rates: list[float] = []
    warm_rates: list[float] = []

    def cold(rate: float) -> float:
        cold_rates.append(rate)
        return measure(rate)

    def warm(rate: float) -> float:
        warm_rates.append(rate)
        return measure(rate)

    a = run_search(search(1.0, doublings, steps), cold)
    b = run_search(search(1.0, doublings, steps, first=first), warm)
    assert a == b
    assert warm_rates[-steps:] == cold_rates[-steps:] or not a.bracketed or steps == 0


@given(
    st.floats(0.01, 5000, allow_nan=False),
    st.integers(0, 14),
    st.integers(0, 4),
    st.integers(1, 12),
    st.integers(0, 11),
    st.integers(0, 4),
)
def test_a_search_told_what_to_beat_ends_as_the_full_search_or_at_once(
    threshold: float, first: int, steps: int, doublings: int, k: int, depth: int
) -> None:
    """``beat`` (a rival's goodput on the same grid: a doubling, or a point bisected inside
    one) costs one measurement: a miss there ends the search (the full search would end below
    it); a pass gives the full search's answer from the full search's own points (``beat`` is
    not measured twice)."""
    from pdserve.bench.sweep import run_search, search

    beat = 2.0**k * (1 + (2**depth - 1) / 2**depth)  # somewhere inside the bracket [2^k, 2^k+1]
    measured: list[float] = []

    def measure(rate: float) -> float:
        measured.append(rate)
        return 1.0 if rate <= threshold else 0.5

    plain: list[float] = []

    def warm(rate: float) -> float:
        plain.append(rate)
        return 1.0 if rate <= threshold else 0.5

    full = run_search(search(1.0, doublings, steps), lambda r: 1.0 if r <= threshold else 0.5)
    told = run_search(search(1.0, doublings, steps, first=first, beat=beat), measure)
    assert measured[0] == beat
    if threshold < beat:
        assert told.stopped and told.failed_at == beat and measured == [beat]
        assert full.goodput < beat
    else:
        assert told == full
        run_search(search(1.0, doublings, steps, first=first), warm)
        assert measured[1:] == [r for r in plain if r != beat]  # the same path, beat once


def test_a_trace_replay_draws_its_prompts_once_per_file_version(tmp_path: Path) -> None:
    """Rates differ only in arrivals: the prompts are drawn once (the same objects), identical to
    a fresh draw; a rewritten trace is read anew."""
    import argparse

    from pdserve.bench.runner import build_workload

    p = tmp_path / "t.jsonl"

    def write(lens: list[int]) -> None:
        rows = [{"timestamp": i * 1000, "input_length": n, "output_length": 2, "hash_ids": [i % 2]}
                for i, n in enumerate(lens)]  # fmt: skip
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def at(rate: float) -> list[RequestSpec]:
        args = argparse.Namespace(
            seed=3, num_prompts=4, dataset_name="trace", dataset_path=p, time_scale=1.0, request_rate=rate,
            vocab_size=256, block_size=16,
        )  # fmt: skip
        return build_workload(args)

    write([20, 30, 40, 50])
    slow, fast = at(1.0), at(4.0)
    assert [r.arrival_s * 4 for r in fast] == pytest.approx([r.arrival_s for r in slow])
    assert all(a.prompt is b.prompt for a, b in zip(slow, fast, strict=True))  # drawn once
    fresh = trace_requests(read_trace(p), 4, time_scale=1.0, vocab=256, block_size=16, rng=random.Random(3))
    assert [r.prompt for r in slow] == [r.prompt for r in fresh]
    write([200, 300, 400, 500, 600])
    assert [r.prompt_len for r in at(1.0)] == [200, 300, 400, 500]


def test_a_passing_beat_does_not_stand_in_for_lower_rates() -> None:
    """A finite run may miss at one rate and pass at a higher one (attainment near 90 % is
    noisy): a pass at ``beat`` must not make the search skip the miss below it."""
    from pdserve.bench.sweep import run_search, search

    def measure(rate: float) -> float:
        return 0.85 if rate == 8.0 or rate > 12.0 else 0.95  # 8 misses, 8.5 passes

    plain = run_search(search(1.0, 8, 3), measure)
    told = run_search(search(1.0, 8, 3, beat=8.5), measure)
    assert told == plain and plain.goodput < 8.0 and plain.failed_at is not None


@given(st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=200))
def test_summary_stats_equal_the_statistics_module(xs: list[float]) -> None:
    """One sort serves the median and every percentile; the deviation is computed in floats."""
    m = summarize([ok(x, []) for x in xs], 1.0, Slo())
    ms = [x * 1000 for x in xs]
    assert m["mean_ttft_ms"] == statistics.fmean(ms)
    assert m["median_ttft_ms"] == statistics.median(ms)
    std = statistics.pstdev(ms) if len(ms) > 1 else 0.0
    assert m["std_ttft_ms"] == pytest.approx(std, rel=1e-9, abs=1e-9)
    assert min(ms) <= m["p90_ttft_ms"] <= m["p99_ttft_ms"] <= max(ms)
