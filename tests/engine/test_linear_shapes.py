"""The ``onednn`` linear backend keeps per-shape state (a cached primitive of 0.6-5 MiB per
distinct row count), so what bounds a worker's memory is how many row counts reach oneDNN: a
fixed few, whatever the step sizes, all of them met when the model loads. The op is wrapped to
record the shapes it is called with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pdserve.decode_worker.offline import OfflineDriver
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.model import linear
from pdserve.model_runtime.model.linear import Linear, _onednn_works, padded_rows, row_buckets
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig

needs_onednn = pytest.mark.skipif(not _onednn_works(torch.float32), reason="oneDNN linear unavailable")


def bound(max_rows: int) -> int:
    """Row counts below 16, then eight per doubling up to ``max_rows`` (rounded up)."""
    return 15 + 8 * max(0, (max_rows - 1).bit_length() - 4) + 1


@pytest.fixture
def onednn_calls() -> Iterator[list[tuple[int, int, int]]]:
    """(rows, in features, out features) of every ``torch.ops.mkldnn._linear_pointwise`` call,
    in order."""
    seen: list[tuple[int, int, int]] = []
    namespace = torch.ops.mkldnn
    op = namespace._linear_pointwise

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        out: torch.Tensor = op(x, *args)
        seen.append((x.shape[0], x.shape[1], out.shape[1]))
        return out

    namespace._linear_pointwise = counting
    try:
        yield seen
    finally:
        namespace._linear_pointwise = op


def test_padded_rows_is_a_small_set_with_little_padding() -> None:
    sizes = range(1, 8193)
    padded = [padded_rows(r) for r in sizes]
    assert padded[:15] == list(range(1, 16))  # decode batches as they are
    for r, p in zip(sizes, padded, strict=True):
        assert r <= p and p - r < r / 8  # less than 1/8 of padding
        assert padded_rows(p) == p  # a padded count is its own bucket
    assert padded == sorted(padded)
    assert len(set(padded[:512])) == 56 == bound(512)
    assert len(set(padded)) == bound(8192)
    for top in (1, 15, 16, 17, 100, 512, 513, 8192):  # what warm_up runs: every padded count
        assert row_buckets(top) == sorted({padded_rows(r) for r in range(1, top + 1)})


@needs_onednn
def test_onednn_sees_a_bounded_set_of_row_counts(onednn_calls: list[tuple[int, int, int]]) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 40), torch.randn(48)
    lin = Linear(weight, bias, "onednn")
    x = torch.randn(600, 40)
    for rows in range(1, 601):
        out = lin(x[:rows])
        assert out.shape == (rows, 48) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x[:rows], weight, bias), atol=1e-4, rtol=1e-4)
    assert len(onednn_calls) == 600
    assert len({rows for rows, _, _ in onednn_calls}) <= bound(600)


@needs_onednn
def test_padding_leaves_the_real_rows_bit_identical() -> None:
    torch.manual_seed(1)
    lin = Linear(torch.randn(96, 64), None, "onednn")
    x = torch.randn(300, 64)
    whole = lin(x[:256])  # 256 is a bucket: no padding
    for rows in (17, 100, 201, 255):
        assert padded_rows(rows) != rows
        assert torch.equal(lin(x[:rows]), whole[:rows])


@needs_onednn
def test_every_shape_a_step_brings_was_made_when_the_model_loaded(
    monkeypatch: pytest.MonkeyPatch, onednn_calls: list[tuple[int, int, int]]
) -> None:
    """A real engine, every prompt length 1..100 (chunked at a 64-token budget) and decode
    batches up to 16: each (rows, in, out) the layers' products and the LM head meet in traffic
    was met at load, and there are no more of those than the buckets allow."""
    monkeypatch.setenv("PDSERVE_LINEAR", "onednn")
    monkeypatch.setattr(linear, "_warmed", set())  # as in a fresh process
    budget, seqs = 64, 16
    engine = OfflineDriver(
        EngineConfig(
            model="tiny",
            device="cpu",
            cache=CacheConfig(block_size=16, num_blocks=256),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs),
        )
    )
    assert engine.runner.model.lm_head.backend == "onednn"
    at_load = set(onednn_calls)
    onednn_calls.clear()
    for n in range(1, 101):
        params = SamplingParams(max_tokens=1 + n % 5, temperature=0)
        engine.add_request(f"r{n}", [3 + (7 * i + n) % 250 for i in range(n)], params)
        if n % 16 == 0:  # decode batches of every size up to 16
            while engine.has_unfinished:
                engine.step()
    while engine.has_unfinished:
        engine.step()
    in_traffic = set(onednn_calls)
    assert len(onednn_calls) > 100
    assert in_traffic <= at_load, sorted(in_traffic - at_load)[:10]
    assert len({rows for rows, _, _ in in_traffic}) <= bound(budget)
