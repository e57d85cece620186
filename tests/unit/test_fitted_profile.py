"""Fitted latency profiles (``pdserve profile``'s output): the fit recovers known coefficients,
JSON round-trips, ``load_profile`` reads both kinds, both kinds satisfy ``StepTimeModel``; a
host calibration wraps either, for the simulator only."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from pdserve.simulator.calibration import Calibrated, HostCalibration, calibration_of, load_sim_profile
from pdserve.steptime.dilation import Dilated
from pdserve.steptime.fitted import FittedProfile, fit_relative, relative_errors
from pdserve.steptime.load import load_profile
from pdserve.steptime.model import StepTimeModel
from pdserve.steptime.roofline import H100_LLAMA3_8B, RooflineProfile

TRUE = FittedProfile(
    name="true",
    prefill_base_s=0.012,
    prefill_per_token_s=8.5e-4,
    prefill_per_token2_s=2.5e-7,
    decode_base_s=0.014,
    decode_per_context_s=4e-6,
    decode_per_seq_s=2.6e-4,
    link_latency_s=2.5e-4,
    link_bw=18e9,
    kv_bytes_per_token=24576,
    kv_capacity_tokens=10912,
    max_model_len=4096,
)
Steps = list[tuple[list[tuple[int, int]], float]]


def fit(prefill: Steps, decode: Steps, name: str = "f", source: str = "") -> FittedProfile:
    return FittedProfile.fit(
        name, prefill, decode, link_latency_s=2.5e-4, link_bw=18e9, kv_bytes_per_token=24576,
        kv_capacity_tokens=10912, max_model_len=4096, source=source,
    )  # fmt: skip


def synthetic(noise: float, seed: int = 0) -> tuple[Steps, Steps]:
    rng = random.Random(seed)

    def measured(chunks: list[tuple[int, int]]) -> float:
        return TRUE.step_time(chunks) * (1 + rng.gauss(0, noise))

    shapes = [[(n, 0)] for n in (16, 64, 128, 256, 512, 1024, 1536)]
    shapes += [[(128, 0)] * 4, [(64, 0)] * 8, [(512, 512)], [(512, 1024)]]
    prefill = [(s, measured(s)) for s in shapes]
    decode = [([(1, c)] * b, measured([(1, c)] * b)) for b in (1, 2, 4, 8, 16, 32) for c in (64, 256, 768)]
    return prefill, decode


def test_fit_recovers_known_coefficients_exactly_without_noise() -> None:
    prefill, decode = synthetic(noise=0.0)
    f = fit(prefill, decode)
    for got, want in zip(f.prefill_coefficients + f.decode_coefficients,
                         TRUE.prefill_coefficients + TRUE.decode_coefficients, strict=True):  # fmt: skip
        assert got == pytest.approx(want, rel=1e-6)
    assert f.prefill_fit_max_error < 1e-9 and f.decode_fit_max_error < 1e-9


def test_fit_with_noise_stays_close_and_reports_its_error() -> None:
    prefill, decode = synthetic(noise=0.03, seed=1)
    f = fit(prefill, decode)
    assert f.prefill_per_token_s == pytest.approx(TRUE.prefill_per_token_s, rel=0.1)
    assert f.decode_base_s == pytest.approx(TRUE.decode_base_s, rel=0.1)
    assert 0 < f.prefill_fit_median_error <= f.prefill_fit_max_error < 0.12
    errs = [abs(e) for e in relative_errors(f, decode)]
    assert max(errs) == pytest.approx(f.decode_fit_max_error)


def test_relative_least_squares_keeps_coefficients_non_negative() -> None:
    # y = 2 + 3x measured with a dip that an unconstrained fit would explain with a negative x²
    xs = [(1.0, x, x * x) for x in (1, 2, 3, 4, 5)]
    ys = [5.0, 8.0, 11.0, 13.0, 14.0]
    theta = fit_relative(xs, ys)
    assert all(t >= 0 for t in theta)
    assert fit_relative([(1.0, 2.0)], [4.0])[1] >= 0
    with pytest.raises(ValueError):
        fit_relative([(1.0,)], [0.0])


def test_fit_rejects_steps_of_the_wrong_kind() -> None:
    prefill, decode = synthetic(noise=0.0)
    with pytest.raises(ValueError, match="prefill"):
        fit([*prefill, decode[0]], decode)
    mixed = [(128, 0), (1, 300)]
    with pytest.raises(ValueError, match="decode"):
        fit(prefill, [*decode, (mixed, 0.2)])


def test_mixed_steps_pay_both_parts_in_full() -> None:
    chunk, decodes = [(512, 0)], [(1, 1000)] * 16
    assert TRUE.step_time(chunk + decodes) == pytest.approx(
        TRUE.prefill_time(512) + TRUE.decode_time(16, 16 * 1001)
    )
    # a continuing chunk attends to its cached prefix: l·(l + 2c)
    assert TRUE.prefill_time(512, 1024) - TRUE.prefill_time(512) == pytest.approx(
        TRUE.prefill_per_token2_s * 512 * 2 * 1024
    )
    assert TRUE.step_time([]) == 0.0 and TRUE.decode_time(0, 0) == 0.0
    served = Calibrated(TRUE, HostCalibration(step_overhead_s=0.003))  # the serving worker's own cost a step
    assert served.step_time(chunk + decodes) == pytest.approx(TRUE.step_time(chunk + decodes) + 0.003)
    assert served.decode_time(16, 16 * 1001) == pytest.approx(served.step_time(decodes))
    assert served.step_time([]) == 0.0
    assert TRUE.transfer_time(1000) == pytest.approx(2.5e-4 + 1000 * 24576 / 18e9)


def test_json_round_trip_and_load_both_kinds(tmp_path: Path) -> None:
    prefill, decode = synthetic(noise=0.02)
    f = fit(prefill, decode, name="cpu-x", source="test")
    path = tmp_path / "fitted.json"
    path.write_text(f.to_json())
    assert json.loads(path.read_text())["kind"] == "fitted"
    assert load_profile(str(path)) == f
    roof = tmp_path / "roofline.json"
    roof.write_text(dataclasses.replace(H100_LLAMA3_8B, name="mine").to_json())
    assert json.loads(roof.read_text())["kind"] == "roofline"
    loaded = load_profile(str(roof))
    assert isinstance(loaded, RooflineProfile) and loaded.name == "mine"
    legacy = {k: v for k, v in json.loads(roof.read_text()).items() if k != "kind"}
    roof.write_text(json.dumps(legacy))  # files written before kinds existed are rooflines
    assert isinstance(load_profile(str(roof)), RooflineProfile)


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"kind": "tpu", "name": "x"}', "unknown kind"),
        ('{"kind": "fitted", "name": "x"}', "not a latency profile"),
        ('["fitted"]', "JSON object"),
        (json.dumps({"kind": "fitted", **json.loads(TRUE.to_json()), "extra": 1}), "unknown fields"),
        (json.dumps({**json.loads(TRUE.to_json()), "decode_base_s": -1.0}), ">= 0"),
    ],
)
def test_load_rejects_bad_files(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_profile(str(path))


def test_both_kinds_are_latency_models() -> None:
    def use(m: StepTimeModel) -> float:
        return m.step_time([(256, 0), (1, 100)]) + m.transfer_time(256) + m.kv_capacity_tokens * 0

    assert use(TRUE) > 0 and use(H100_LLAMA3_8B) > 0


def test_shared_host_slows_decode_steps_while_the_other_worker_prefills(tmp_path: Path) -> None:
    """1P+1D on one host: request A decodes alone, then B's long prompt is prefilled on the other
    worker. With --shared-host, A's steps that start during that prefill take decode_coactive_x
    times as long; on separate devices (the default) nothing changes."""
    import argparse

    from pdserve.bench.workload import RequestSpec
    from pdserve.planning.simulate import add_simulate_args, simulate

    prof = Calibrated(TRUE, HostCalibration(decode_coactive_x=2.0, prefill_coactive_x=1.5))
    path = tmp_path / "p.json"
    path.write_text(prof.to_json())
    a = RequestSpec(0.0, tuple(range(1, 33)), 32, 200)
    b = RequestSpec(0.5, tuple(range(100, 1100)), 1000, 2)
    b_prefill = TRUE.prefill_time(1000)
    itl = TRUE.decode_time(1, 33 + 50)  # A's step, about 14 ms

    def run(*extra: str) -> dict[str, object]:
        p = argparse.ArgumentParser()
        add_simulate_args(p)
        flags = [
            "--prefill",
            "1",
            "--decode",
            "1",
            "--profile",
            str(path),
            "--max-num-batched-tokens",
            "2048",
        ]
        return simulate(p.parse_args([*flags, *extra]), [a, b])

    alone, shared = run(), run("--shared-host")
    a_alone, a_shared = alone["itls"][0][1:], shared["itls"][0][1:]  # type: ignore[index]  # [0]: hand-off
    # apart from the one step B joins with its 1,000-token context, A's steps never slow alone
    assert sum(x > 1.2 * itl for x in a_alone) == 1 and max(a_alone) < 1.4 * itl
    ratios = [x / y for x, y in zip(a_shared, a_alone, strict=True)]  # same token, same batch
    slow = [r for r in ratios if r > 1.6]
    assert all(r == pytest.approx(2.0, rel=0.02) for r in slow)
    assert sum(abs(r - 1) < 0.02 for r in ratios) >= len(ratios) - len(slow) - 2
    # as many of A's steps as fit in B's prefill (itself 1.5x slower: A was stepping) are slowed
    assert len(slow) == pytest.approx(1.5 * b_prefill / (2 * itl), abs=2)
    assert shared["ttfts"][1] > alone["ttfts"][1] * 1.4  # type: ignore[index]
    with pytest.raises(ValueError, match="slowdowns"):
        HostCalibration(decode_coactive_x=0.5)
    stretched = Dilated(prof, 8.0)  # time dilation stretches durations, not their ratios
    assert calibration_of(stretched) == prof.calibration
    assert load_sim_profile(f"{path}@x8") == stretched


def test_a_calibrated_profile_is_for_the_simulator_only(tmp_path: Path) -> None:
    cal = Calibrated(TRUE, HostCalibration(prefill_x=1.2, decode_s=0.001, prefill_jitter=(0.9, 1.0, 1.3)))
    path = tmp_path / "cal.json"
    path.write_text(cal.to_json())
    assert load_sim_profile(str(path)) == cal  # JSON lists back to tuples
    with pytest.raises(ValueError, match="unknown kind 'calibrated'"):
        load_profile(str(path))  # emulated workers and the router take engine profiles
    data = json.loads(cal.to_json())
    data["calibration"]["decode_x"] = 0.0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="service factors"):
        load_sim_profile(str(path))


MODELS: list[StepTimeModel] = [
    H100_LLAMA3_8B,
    TRUE,
    Dilated(H100_LLAMA3_8B, 4.0),
    Calibrated(TRUE, HostCalibration(step_overhead_s=0.002, prefill_x=1.3, decode_x=0.8, decode_s=0.001)),
]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize(
    "chunks, decodes, context",
    [([], 0, 0), ([], 1, 1), ([], 200, 200 * 1500), ([(512, 0)], 0, 0), ([(700, 300)], 150, 150 * 900),
     ([(1, 40), (2048, 0)], 7, 7 * 3), ([(1, 99)], 64, 64 * 2048)],
)  # fmt: skip
def test_mixed_time_is_the_step_with_a_chunk_per_decode(
    model: StepTimeModel, chunks: list[tuple[int, int]], decodes: int, context: int
) -> None:
    """``mixed_time`` prices ``decodes`` decode tokens at contexts summing to ``context`` as
    ``step_time`` prices a chunk each (here each at the mean context)."""
    each = [(1, context // decodes)] * decodes if decodes else []
    assert model.mixed_time(chunks, decodes, context) == pytest.approx(
        model.step_time(chunks + each), rel=1e-12
    )
