"""Token-exact greedy equality with Hugging Face transformers (float32 reference)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.decode_worker.offline import OfflineDriver
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.engine.batch import build_batch
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import ScheduledChunk, SchedulerConfig
from tests.engine.hf_models import VOCAB, hf_greedy, make_hf_model

PROMPT_LENS = [1, 5, 16, 17, 40, 129, 257, 310, 64, 3]
GEN = 32


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    d = tmp_path_factory.mktemp(kind)
    model = make_hf_model(kind, d, seed=len(kind))
    rng = random.Random(kind)
    shared = [rng.randrange(3, VOCAB) for _ in range(48)]  # a common prefix for cache hits
    prompts = []
    for i, n in enumerate(PROMPT_LENS):
        p = [rng.randrange(3, VOCAB) for _ in range(n)]
        if i % 3 == 0 and n > len(shared):
            p[: len(shared)] = shared
        prompts.append(p)
    expected = [hf_greedy(model, p, GEN) for p in prompts]
    return kind, d, prompts, expected


def _engine(path: Path, backend: str = "torch", **sched: Any) -> OfflineDriver:
    return OfflineDriver(
        EngineConfig(
            model=str(path),
            device="cpu",
            backend=backend,
            cache=CacheConfig(block_size=16, num_blocks=512),
            scheduler=SchedulerConfig(**{"max_num_batched_tokens": 512, **sched}),
        )
    )


GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


def _run_all(engine: OfflineDriver, prompts: list[list[int]], join_after: int = 0) -> dict[int, list[int]]:
    """Run prompts; the second half joins after ``join_after`` steps (mid-flight)."""
    half = len(prompts) // 2 if join_after else len(prompts)
    for i in range(half):
        engine.add_request(f"r{i}", prompts[i], GREEDY)
    got: dict[int, list[int]] = {}
    steps = 0
    while engine.has_unfinished or len(got) < len(prompts):
        if steps == join_after and half < len(prompts):
            for i in range(half, len(prompts)):
                engine.add_request(f"r{i}", prompts[i], GREEDY)
        for out in engine.step():
            if out.finished:
                got[int(out.request_id[1:])] = out.token_ids
        steps += 1
        assert steps < 10_000
    engine.check_integrity()
    return got


@pytest.mark.parametrize(
    "sched,join_after",
    [
        ({}, 0),
        ({"max_prefill_chunk": 7}, 3),
        ({"max_num_batched_tokens": 7}, 0),
        ({"max_num_seqs": 3, "max_num_batched_tokens": 64}, 5),
    ],
    ids=["one-pass", "chunk7-joining", "budget7", "few-seqs-joining"],
)
@pytest.mark.parametrize("backend", ["torch", "paged"])
def test_greedy_tokens_match_hf(reference: Any, sched: dict[str, Any], join_after: int, backend: str) -> None:
    """``paged`` on CPU: the GPU backend's step packing, decode buckets and fused-op contracts,
    with the ops' torch references (``test_paged_backend`` runs its Triton kernels)."""
    kind, path, prompts, expected = reference
    engine = _engine(path, backend, **sched)
    got = _run_all(engine, prompts, join_after)
    for i, (toks, _) in enumerate(expected):
        assert got[i] == toks, f"{kind} prompt {i} (len {len(prompts[i])}) diverged"
    # Second pass over the same prompts: served partly from the prefix cache, same tokens.
    got2 = _run_all(engine, prompts, join_after)
    assert engine.kv.pool.num_hits > 0
    for i, (toks, _) in enumerate(expected):
        assert got2[i] == toks, f"{kind} prompt {i} diverged on a prefix-cache hit"
    assert engine.kv.stats().used == 0


def test_last_position_logits_match_hf(reference: Any) -> None:
    _, path, prompts, expected = reference
    engine = _engine(path)
    runner = engine.runner
    for prompt, (_, ref_logits) in zip(prompts, expected, strict=True):
        table = tuple(range(-(-len(prompt) // 16)))
        chunk = ScheduledChunk("x", tuple(prompt), 0, table, sample=True)
        batch = build_batch([chunk], 16, runner.device, runner.config.sliding_window)
        logits = runner.model.forward(
            batch.input_ids, batch.positions, batch.meta, runner.kv_cache, batch.sample_rows
        )[0]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
