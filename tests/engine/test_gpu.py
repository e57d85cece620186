"""The same engine code on CUDA (skipped without a GPU; run by benchmarks/gpu_engine_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.engine.llm_engine import LLMEngine
from pdserve.model_runtime.sampling_params import SamplingParams
from tests.engine.hf_models import hf_greedy, make_hf_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _engine(model: str, dtype: str | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cuda", dtype=dtype, cache=CacheConfig(num_blocks=512)))


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
