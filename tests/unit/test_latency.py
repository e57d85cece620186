"""The latency model behind emulated workers: calibration points and shape."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.steptime.load import load_profile
from pdserve.steptime.roofline import H100_LLAMA3_8B as P


def test_calibrated_on_published_h100_points() -> None:
    assert P.prefill_time(2048) == pytest.approx(0.0467, rel=0.1)  # 2k-token prefill ≈ 46.7 ms
    assert P.decode_time(1, 1024) == pytest.approx(0.0066, rel=0.05)  # batch-1 step ≈ 6.6 ms
    assert P.kv_bytes_per_token == 128 * 1024  # Llama-3.1-8B bf16
    assert 0.0015 <= P.transfer_time(2048) <= 0.005  # 268 MB over an NVLink-class link


def test_shape_of_the_model() -> None:
    # Decode is bandwidth-bound: batching is nearly free until the KV reads add up.
    assert P.decode_time(32, 32 * 1024) < 2 * P.decode_time(1, 1024)
    assert P.decode_time(32, 32 * 8192) > P.decode_time(32, 32 * 1024)
    # Prefill grows faster than linearly (attention), and a cached prefix is cheaper than computing it.
    assert P.prefill_time(8192) > 4 * P.prefill_time(2048)
    assert P.prefill_time(512, cached_tokens=4096) < P.prefill_time(4608)
    # Decode tokens riding along a prefill chunk share its GEMMs (16 more rows), but their
    # attention is not hidden under them: the KV reads are paid on top.
    mixed = P.step_time([(512, 0)] + [(1, 1000)] * 16)
    assert mixed - P.prefill_time(512) >= 16 * 1000 * P.kv_bytes_per_token / P.mem_bw
    assert P.step_time([]) == 0.0


def test_profiles_load_by_name_or_file(tmp_path: Path) -> None:
    assert load_profile("h100-llama3-8b") is P
    f = tmp_path / "p.json"
    f.write_text(dataclasses.replace(P, name="mine", link_bw=50e9).to_json())
    assert load_profile(str(f)).link_bw == 50e9
    with pytest.raises(ValueError, match="unknown latency profile"):
        load_profile("tpu-v9")
    f.write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="not a latency profile"):
        load_profile(str(f))


def test_time_dilation_stretches_every_duration_and_nothing_else() -> None:
    d = load_profile("h100-llama3-8b@x4")
    assert d.name == "h100-llama3-8b@x4"
    assert d.prefill_time(1000, 200) == pytest.approx(4 * P.prefill_time(1000, 200))
    assert d.decode_time(16, 20000) == pytest.approx(4 * P.decode_time(16, 20000))
    assert d.step_time([(512, 0), (1, 900)]) == pytest.approx(4 * P.step_time([(512, 0), (1, 900)]))
    assert d.transfer_time(2048) == pytest.approx(4 * P.transfer_time(2048))
    assert (d.kv_capacity_tokens, d.max_model_len, d.kv_bytes_per_token) == (
        P.kv_capacity_tokens,
        P.max_model_len,
        P.kv_bytes_per_token,
    )
    assert load_profile("h100-llama3-8b@x1") is P
    for bad in ("h100-llama3-8b@x0.5", "h100-llama3-8b@x5000", "nope@x4"):
        with pytest.raises(ValueError):
            load_profile(bad)
