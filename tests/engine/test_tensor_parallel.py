"""Tensor-parallel engines on CPU (gloo): the ranks' forward gives Hugging Face's greedy tokens,
seeded sampling draws the TP 1 tokens, and a degree the model cannot shard is refused."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.decode_worker.offline import OfflineDriver
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.parallel.group import RankLost
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from tests.engine.hf_models import VOCAB, hf_greedy, make_hf_model

GEN = 12
GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 19, 40)]


# (kind, config overrides, the degrees run): four KV heads split over 2 and 4 ranks; two KV heads
# replicated over 4 ranks; Qwen2's biases, tied head and single KV head replicated on every rank.
CASES = {
    "llama-4kv": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4}, (4,)),
    "llama-2kv": ("llama", {}, (4,)),
    "qwen2": ("qwen2", {}, (2,)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind, over, degrees = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    model = make_hf_model(kind, d, seed=7, **over)
    prompts = _prompts(len(request.param))
    return d, prompts, [hf_greedy(model, p, GEN)[0] for p in prompts], degrees


def _engine(path: Path, tp: int, **kw: Any) -> OfflineDriver:
    return OfflineDriver(
        EngineConfig(
            model=str(path),
            device="cpu",
            backend="torch",
            tp=tp,
            cache=CacheConfig(block_size=8, num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=64),
            **kw,
        )
    )


def _check_clean(engine: OfflineDriver) -> None:
    engine.check_integrity()
    assert engine.runner.kept_requests() == 0


def test_tp_greedy_matches_hugging_face(reference: Any) -> None:
    path, prompts, expected, degrees = reference
    for tp in degrees:
        engine = _engine(path, tp)
        try:
            got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
            assert got == expected, f"TP {tp}"
            _check_clean(engine)
        finally:
            engine.runtime.close()


def test_seeded_sampling_draws_the_same_tokens_at_every_degree(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, seed=3, num_attention_heads=8, num_key_value_heads=4)
    prompts = _prompts(5)
    params = [SamplingParams(max_tokens=GEN, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(4)]
    outs = {}
    for tp in (1, 2):
        engine = _engine(tmp_path, tp, overlap="on")  # pending inputs reach the other rank too
        try:
            outs[tp] = [o.token_ids for o in engine.generate(prompts, params)]
            _check_clean(engine)
        finally:
            engine.runtime.close()
    assert outs[1] == outs[2]


def test_a_degree_the_model_cannot_shard_is_refused_with_the_valid_ones(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, seed=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=48)
    with pytest.raises(ModelLoadError, match=r"valid degrees: 1, 2, 4"):
        _engine(tmp_path, 8)


def test_a_rank_that_dies_fails_the_next_step_instead_of_hanging(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, seed=2, num_attention_heads=8, num_key_value_heads=4)
    engine = _engine(tmp_path, 2, tp_timeout_s=5.0)
    try:
        setup = engine.runtime.ranks
        assert setup is not None and setup.ranks is not None
        os.kill(setup.ranks.pids[0], signal.SIGKILL)
        engine.add_request("r", [5, 6, 7], GREEDY)
        with pytest.raises(RankLost):
            while engine.has_unfinished:
                engine.step()
    finally:
        engine.runtime.close()


def test_a_stalled_rank_fails_the_step_within_the_collective_timeout(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path, seed=2, num_attention_heads=8, num_key_value_heads=4)
    engine = _engine(tmp_path, 2, tp_timeout_s=1.5)
    setup = engine.runtime.ranks
    assert setup is not None and setup.ranks is not None
    pid = setup.ranks.pids[0]
    try:
        os.kill(pid, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        engine.add_request("r", [5, 6, 7], GREEDY)
        t0 = time.monotonic()
        with pytest.raises(RankLost):
            while engine.has_unfinished:
                engine.step()
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.runtime.close()
