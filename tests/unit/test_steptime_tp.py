"""The roofline at a tensor-parallel degree: per-rank memory and work, the all-reduces."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.simulator.calibration import Calibrated, HostCalibration
from pdserve.steptime.dilation import Dilated
from pdserve.steptime.fitted import FittedProfile
from pdserve.steptime.load import load_profile
from pdserve.steptime.parallel import at_tp, tp_of, valid_tp
from pdserve.steptime.roofline import H100_LLAMA3_8B as P
from pdserve.steptime.roofline import H100_LLAMA3_70B as BIG

STEP = [(1000, 0), (1, 700), (1, 300)]


def test_degree_one_is_the_single_gpu_model() -> None:
    one = P.at_tp(1)
    assert one is P and tp_of(P) == 1 and P.valid_tp() == (1, 2, 4, 8)
    # the single-GPU formula, written out
    lin = max(2 * P.params * 1002 / (P.peak_flops * P.mfu), P.weight_bytes / (P.mem_bw * P.mbu))
    attn = 4 * P.layers * P.heads * P.head_dim * 1000 * 500 / (P.peak_flops * P.mfu_attn)
    kv = 1002 * P.kv_bytes_per_token / (P.mem_bw * P.mbu)
    assert P.step_time(STEP) == P.step_overhead_s + lin + attn + kv
    assert P.kv_capacity_tokens == int((P.memory_bytes - P.weight_bytes) * 0.9 // P.kv_bytes_per_token)


def test_a_degree_divides_the_work_and_adds_two_all_reduces_a_layer() -> None:
    t = 4
    four = BIG.at_tp(t)
    assert four.name == "h100-llama3-70b@tp4" and four.tp == 4
    tokens = 1002
    lin = max(
        2 * BIG.params * tokens / (t * BIG.peak_flops * BIG.mfu),
        BIG.weight_bytes / (t * BIG.mem_bw * BIG.mbu),
    )
    attn = 4 * BIG.layers * BIG.heads * BIG.head_dim * 1000 * 500 / (t * BIG.peak_flops * BIG.mfu_attn)
    kv = 1002 * (BIG.kv_bytes_per_token / t) / (BIG.mem_bw * BIG.mbu)
    reduce = 2 * (t - 1) / t * 8192 * tokens * 2 / 450e9 + BIG.tp_link_latency_s
    assert four.step_time(STEP) == pytest.approx(BIG.step_overhead_s + lin + attn + kv + 2 * 80 * reduce)
    # the closed-form decode step agrees with the chunked one
    assert four.decode_time(2, 998) == pytest.approx(four.step_time([(1, 499), (1, 499)]))
    # a faster link only shortens the all-reduce term
    fast = dataclasses.replace(four, tp_link_bw=1e30, tp_link_latency_s=0.0)
    assert four.step_time(STEP) - fast.step_time(STEP) == pytest.approx(2 * 80 * reduce)


def test_kv_capacity_is_per_rank_and_replicates_heads_past_kv_heads() -> None:
    for t in (2, 4, 8):
        at = BIG.at_tp(t)
        per_token = BIG.kv_bytes_per_token / t  # 8 KV heads split over t ranks
        assert at.kv_capacity_tokens == int((80e9 - BIG.weight_bytes / t) * 0.9 // per_token)
    # 8 KV heads on 16 ranks: each holds one (replicated), so a token costs a rank as much as at 8
    wide = dataclasses.replace(BIG, name="wide", memory_bytes=160e9).at_tp(16)
    assert wide.kv_heads_per_rank == 1
    assert (
        wide.kv_bytes_per_rank_token == dataclasses.replace(BIG, name="wide").at_tp(8).kv_bytes_per_rank_token
    )
    assert wide.kv_capacity_tokens == int(
        (160e9 - BIG.weight_bytes / 16) * 0.9 // wide.kv_bytes_per_rank_token
    )
    # KV a decode token reads per rank stops shrinking there too
    narrow = dataclasses.replace(P, kv_heads=2)
    assert narrow.at_tp(8).kv_bytes_per_rank_token == narrow.at_tp(2).kv_bytes_per_rank_token


def test_a_70b_model_is_refused_where_its_weights_do_not_fit() -> None:
    assert BIG.valid_tp() == (2, 4, 8)
    for bad in (
        lambda: BIG.at_tp(1),
        lambda: BIG.kv_capacity_tokens,
        lambda: load_profile("h100-llama3-70b@tp1"),
    ):
        with pytest.raises(ValueError, match=r"does not fit at tp=1.*valid degrees: 2, 4, 8"):
            bad()
    with pytest.raises(ValueError, match="divide the 64 attention heads"):
        BIG.at_tp(3)


def test_a_degree_passes_through_wrappers_and_names() -> None:
    wrapped = Calibrated(Dilated(BIG, 4.0), HostCalibration(prefill_x=2.0))
    at = at_tp(wrapped, 8)
    assert tp_of(at) == 8 and valid_tp(wrapped) == (2, 4, 8)
    assert at.step_time(STEP) == pytest.approx(2.0 * 4.0 * BIG.at_tp(8).step_time(STEP))
    assert load_profile("h100-llama3-70b@tp2@x4").step_time(STEP) == pytest.approx(
        4 * BIG.at_tp(2).step_time(STEP)
    )
    fitted = FittedProfile(
        name="f", prefill_base_s=0.03, prefill_per_token_s=8e-4, prefill_per_token2_s=3e-7,
        decode_base_s=0.013, decode_per_context_s=5e-6, decode_per_seq_s=1e-3, link_latency_s=1e-4,
        link_bw=1e10, kv_bytes_per_token=1000, kv_capacity_tokens=100000, max_model_len=8192,
    )  # fmt: skip
    assert at_tp(fitted, 1) is fitted
    with pytest.raises(ValueError, match="measured at tp=1"):
        at_tp(fitted, 2)
