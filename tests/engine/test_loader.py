"""Model loading: formats, presets, and one-line errors for everything a user can get wrong."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from pdserve.decode_worker.offline import OfflineDriver
from pdserve.model_runtime.checkpoint import Checkpoint
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.errors import InvalidRequestError, ModelLoadError
from pdserve.model_runtime.model.loader import load_model, resolve_dtype
from pdserve.model_runtime.presets import PRESETS, materialize, preset_path
from pdserve.model_runtime.sampling_params import SamplingParams
from tests.engine.hf_models import hf_greedy, make_hf_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", d)
    return d


def load(path: Path) -> object:
    checkpoint = Checkpoint.at(path)
    return load_model(checkpoint, checkpoint.model_config(), CPU, torch.float32, 128)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def small_engine(model: str, **kw: object) -> OfflineDriver:
    kw.setdefault("device", "cpu")
    return OfflineDriver(EngineConfig(model=model, cache=CacheConfig(num_blocks=64), **kw))  # type: ignore[arg-type]


def test_unsupported_architecture(llama_dir: Path, tmp_path: Path) -> None:
    d = copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load(d)


def test_missing_and_corrupt_weights(llama_dir: Path, tmp_path: Path) -> None:
    d = copy(llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load(d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="corrupt"):
        load(d)
    with pytest.raises(ModelLoadError, match=r"no config\.json and no \.gguf"):
        load(tmp_path)
    with pytest.raises(ModelLoadError, match="no such model file or directory"):
        load(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no such model file or directory"):
        small_engine(str(tmp_path / "nope"))


def test_shape_mismatch(llama_dir: Path, tmp_path: Path) -> None:
    d = copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"gate_proj\.weight' has shape"):
        load(d)


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    model = make_hf_model("llama", tmp_path / "sharded")
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    prompt = list(range(3, 40))
    ref, _ = hf_greedy(model, prompt, 8)
    eng = small_engine(str(tmp_path / "sharded"))
    out = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == ref
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load(tmp_path / "sharded")


def test_no_tokenizer_serves_token_ids_and_rejects_text(llama_dir: Path) -> None:
    eng = small_engine(str(llama_dir))
    assert eng.tokenizer is None
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) >= 1 and out.text is None
    with pytest.raises(InvalidRequestError, match="without tokenizer"):
        eng.add_request("t", "some text", SamplingParams())
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        eng.add_request("t", [1, 2], SamplingParams(stop=("x",)))
    eng.check_integrity()


def test_dtypes(llama_dir: Path) -> None:
    assert resolve_dtype(None, CPU) is torch.float32
    assert resolve_dtype("bf16", CPU) is torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("int3", CPU)
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            resolve_dtype("bfloat16", torch.device("cuda"))
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            small_engine(str(llama_dir), device="cuda")
    eng = small_engine(str(llama_dir), dtype="bfloat16")
    assert eng.runner.kv_cache.dtype is torch.bfloat16
    out = eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6


def test_presets_are_deterministic_and_tiny_loads_fast(tmp_path: Path) -> None:
    def digest(d: Path) -> str:
        return hashlib.sha256(
            b"".join((d / f).read_bytes() for f in sorted(p.name for p in d.iterdir()))
        ).hexdigest()

    a = materialize(PRESETS["tiny"], tmp_path)
    b = materialize(PRESETS["tiny"], tmp_path)
    assert digest(a) == digest(b)
    path = preset_path("tiny")
    assert digest(path) == digest(a)
    t0 = time.perf_counter()
    eng = OfflineDriver(EngineConfig(model="tiny", device="cpu", cache=CacheConfig(num_blocks=64)))
    assert time.perf_counter() - t0 < 1.0
    assert eng.tokenizer is not None and eng.model_config.num_kv_heads < eng.model_config.num_heads
