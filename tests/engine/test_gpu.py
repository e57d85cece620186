"""The same engine code on CUDA (skipped without a GPU; run by benchmarks/gpu_engine_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.decode_worker.offline import OfflineDriver
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.sampling_params import SamplingParams
from tests.engine.hf_models import hf_greedy, make_hf_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _engine(model: str, dtype: str | None) -> OfflineDriver:
    return OfflineDriver(
        EngineConfig(model=model, device="cuda", dtype=dtype, cache=CacheConfig(num_blocks=512))
    )


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_cuda_float32_matches_hf(kind: str, tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_hf_model(kind, tmp_path, seed=3)
    prompts = [list(range(3, 3 + n)) for n in (1, 17, 100, 300)]
    expected = [hf_greedy(model, p, 32)[0] for p in prompts]
    engine = _engine(str(tmp_path), "float32")
    assert engine.runner.kv_cache.is_cuda
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == expected


def test_cuda_bfloat16_default_serves_and_frees() -> None:
    engine = _engine("tiny", None)
    assert engine.runner.kv_cache.dtype is torch.bfloat16
    outs = engine.generate(["hello"] * 8 + ["a longer prompt " * 20], GREEDY)
    assert all(len(o.token_ids) == 32 for o in outs)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    a = engine.generate(["x"], seeded)[0].token_ids
    b = engine.generate(["y", "x"], [GREEDY, seeded])[1].token_ids
    assert a == b
    engine.check_integrity()


def test_paged_backend_is_the_cuda_default_and_captures_graphs() -> None:
    engine = _engine("tiny", None)
    assert engine.runner.model.backend.value == "paged"
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.graphs  # captured, one per bucket
    engine.generate(["warm"], GREEDY)
    engine.check_integrity()


def test_overlapped_decode_on_cuda_equals_synchronous() -> None:
    """Graph replays fed from the previous step's sampled ids on the device, two pinned copies
    in flight, events on the model's stream: the same tokens and logprobs as reading each step
    before the next (float32, so the two runs' arithmetic is the same)."""
    from tests.engine.test_overlap_engine import check_overlap_matches, runtime

    torch.backends.cuda.matmul.allow_tf32 = False
    check_overlap_matches(lambda: runtime("paged", "cuda", "float32"))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_cuda_graph_decode_equals_eager_and_hf(kind: str, tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_hf_model(kind, tmp_path, seed=5)
    prompts = [list(range(3, 3 + n)) for n in (1, 17, 100, 300, 5, 9, 70)]
    expected = [hf_greedy(model, p, 32)[0] for p in prompts]
    for graphs in (True, False):
        engine = OfflineDriver(
            EngineConfig(
                model=str(tmp_path),
                device="cuda",
                dtype="float32",
                cuda_graphs=graphs,
                cache=CacheConfig(num_blocks=512),
            )
        )
        assert (engine.runner.graphs is not None) == graphs
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected, f"graphs={graphs}"
        engine.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_on_cuda_match_their_references(dtype: torch.dtype) -> None:
    from pdserve.model_runtime.kernels import fused, reference
    from pdserve.model_runtime.kernels import paged_attention as pa
    from pdserve.model_runtime.kv_cache.tensors import new_kv_cache

    gen = torch.Generator(device="cuda").manual_seed(0)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    cache = new_kv_cache((2, 384, 2, 16, 8, 128), dtype, "cuda")
    cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda").to(dtype))
    kv = cache[1]
    lens = torch.tensor([1, 700, 1024, 0, 33], dtype=torch.int32, device="cuda")
    tables = torch.randperm(383, device="cuda", generator=gen)[: 5 * 64].view(5, 64).to(torch.int32) + 1
    q = torch.randn(5, 32, 128, generator=gen, device="cuda").to(dtype)
    for window in (0, 300):
        for splits in ((16, 64), (4, 256), (1, 64), (64, 64)):
            got = pa.paged_decode(q, kv, tables, lens, 0.088, window, *splits)
            torch.testing.assert_close(got, reference.paged_decode(q, kv, tables, lens, 0.088, window), **tol)
    cu = torch.tensor([0, 300, 301, 1301], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 700, 24], dtype=torch.int32, device="cuda")
    qp = torch.randn(1301, 32, 128, generator=gen, device="cuda").to(dtype)
    got = pa.paged_prefill(qp, kv, tables[:3], cu, starts, 1000, 0.088, 0)
    torch.testing.assert_close(
        got, reference.paged_prefill(qp, kv, tables[:3], cu, starts, 1000, 0.088, 0), **tol
    )
    x = torch.randn(64, 4096, generator=gen, device="cuda").to(dtype)
    w = torch.randn(4096, generator=gen, device="cuda").to(dtype)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **tol)
    gu = torch.randn(64, 2 * 1024, generator=gen, device="cuda").to(dtype)
    torch.testing.assert_close(fused.silu_mul(gu), reference.silu_mul(gu), **tol)


def test_tp_code_paths_run_on_cuda_at_degree_one(tmp_path: Path) -> None:
    """A one-rank NCCL group through the TP forward (vocabulary-sharded embedding and head,
    all-reduces after O and down, the logits gather): one GPU cannot hold two NCCL ranks, so
    this is the TP path's CUDA check; the degrees above one run under gloo on CPU."""
    from pdserve.model_runtime.engine.model_runner import ModelRunner
    from pdserve.model_runtime.model.loader import TPRank, load_model
    from pdserve.model_runtime.parallel.group import TPGroup, serve_store
    from pdserve.model_runtime.parallel.launch import RankSetup
    from pdserve.model_runtime.parallel.sharding import shape_of, shard
    from pdserve.model_runtime.presets import resolve_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_hf_model("llama", tmp_path, seed=4, num_attention_heads=8, num_key_value_heads=4)
    prompts = [list(range(3, 3 + n)) for n in (1, 17, 100)]
    expected = [hf_greedy(model, p, 16)[0] for p in prompts]
    checkpoint = resolve_model(str(tmp_path))
    config = checkpoint.model_config()
    dev = torch.device("cuda", 0)
    group = TPGroup(0, 1, serve_store(), dev)
    try:
        tp = TPRank(shard(shape_of(config), 1, 0), group)
        engine = OfflineDriver(  # no decode graphs: they would replay the unsharded model
            EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", cuda_graphs=False)
        )
        sharded = load_model(checkpoint, config, dev, torch.float32, 1024, engine.runner.model.backend, tp)
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        runner.model = sharded
        runner.tp = RankSetup(tp.shard, group)
        greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        got = [o.token_ids for o in engine.generate(prompts, greedy)]
        assert got == expected
    finally:
        group.close()
