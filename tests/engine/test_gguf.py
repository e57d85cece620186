"""GGUF checkpoints: dequantization against transformers' GGUF loader, tensor for tensor; greedy
tokens against transformers on the same file; one-line errors for what we do not run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.decode_worker.offline import OfflineDriver
from pdserve.model_runtime.checkpoint import Checkpoint, Format
from pdserve.model_runtime.config import CacheConfig, EngineConfig
from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.model.gguf import QUANT_TYPES, GGUFWeights, open_gguf
from pdserve.model_runtime.model.layers import rope_inv_freq
from pdserve.model_runtime.sampling_params import SamplingParams
from tests.engine.gguf_files import (
    K_SCALE_OFFSETS,
    QUANTIZABLE,
    gguf,
    hf_model,
    smollm2_path,
    smollm2_reference,
    transformers,
    write_gguf,
)
from tests.engine.hf_models import hf_greedy

TESTED = (*QUANTIZABLE, *K_SCALE_OFFSETS)


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return dict(model.state_dict())


def ours(path: Path) -> GGUFWeights:
    checkpoint = Checkpoint.at(path)
    assert checkpoint.format is Format.GGUF
    return GGUFWeights(open_gguf(path), checkpoint.model_config())


def assert_same_tensors(path: Path, reference: dict[str, torch.Tensor]) -> int:
    mine = ours(path)
    compared = 0
    for name, ref in reference.items():
        if name == "lm_head.weight" and not mine.has(name):
            continue  # tied to the embedding
        got = mine.get(name, tuple(ref.shape))
        assert torch.equal(got, ref), f"{name}: max |diff| {(got - ref).abs().max()}"
        compared += 1
    return compared


def test_every_listed_type_is_supported_and_tested() -> None:
    assert set(TESTED) == set(QUANT_TYPES)


@pytest.mark.parametrize("kind", TESTED)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dequantized_tensors_equal_transformers(tmp_path: Path, kind: str, arch: str) -> None:
    model = hf_model(arch, tie_word_embeddings=arch == "qwen2")
    path = write_gguf(tmp_path / f"m-{kind}.gguf", model, kind, arch=arch)
    assert assert_same_tensors(path, hf_state(path)) >= 2 * 9 + 2


def test_f32_round_trip_is_the_original_model(tmp_path: Path) -> None:
    """Independent of transformers: the Q/K interleave is undone exactly."""
    model = hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", model, "F32")
    assert assert_same_tensors(path, dict(model.state_dict())) == len(model.state_dict())


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_greedy_tokens_equal_transformers_on_the_same_file(tmp_path: Path, kind: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", seed=3), kind)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    engine = OfflineDriver(EngineConfig(model=str(path), device="cpu", cache=CacheConfig(num_blocks=64)))
    prompts = [[5, 9, 33, 100, 7], list(range(40, 90)), [300, 2, 17]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        assert out.token_ids == hf_greedy(reference, prompt, 16)[0]
    engine.check_integrity()


def test_directory_with_one_gguf_and_with_several(tmp_path: Path) -> None:
    model = hf_model("llama")
    write_gguf(tmp_path / "a.gguf", model, "Q8_0")
    assert Checkpoint.at(tmp_path) == Checkpoint(tmp_path / "a.gguf", Format.GGUF)
    write_gguf(tmp_path / "b.gguf", model, "Q8_0")
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        Checkpoint.at(tmp_path)


def test_unsupported_architecture_and_quantization_are_named(tmp_path: Path) -> None:
    model = hf_model("llama")
    path = write_gguf(tmp_path / "gpt2.gguf", model, "F16", arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'gpt2'; supported: llama"):
        Checkpoint.at(path).model_config()

    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    w.add_tensor(
        "token_embd.weight", np.zeros((4, 8 * size), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = open_gguf(tmp_path / "iq.gguf")
    with pytest.raises(ModelLoadError, match=r"'token_embd\.weight' uses quantization type IQ4_NL"):
        f.read("token_embd.weight")


def test_missing_tensor_and_not_a_gguf(tmp_path: Path) -> None:
    model = hf_model("llama")
    gone = "model.layers.1.mlp.up_proj.weight"
    path = write_gguf(tmp_path / "m.gguf", model, "F16", skip=frozenset({gone}))
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.1\.ffn_up\.weight' is missing"):
        ours(path).get(gone, (512, 256))
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.1\.ffn_up\.weight' is missing"):
        OfflineDriver(EngineConfig(model=str(path), device="cpu", cache=CacheConfig(num_blocks=8)))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        Checkpoint.at(bad).model_config()
    with pytest.raises(ModelLoadError, match=r"a Hugging Face directory or a \.gguf file"):
        Checkpoint.at(Path(__file__))


def test_rope_freq_factors_divide_the_frequencies(tmp_path: Path) -> None:
    model = hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", model, "F32")
    w = gguf.GGUFWriter(str(tmp_path / "r.gguf"), "llama")
    reader = gguf.GGUFReader(path)
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                "attention.head_count", "attention.head_count_kv"):  # fmt: skip
        w.add_uint32(f"llama.{key}", int(reader.fields[f"llama.{key}"].contents()))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.vocab_size", 320)
    factors = np.linspace(1.0, 8.0, 32, dtype=np.float32)
    w.add_tensor("rope_freqs.weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = Checkpoint.at(tmp_path / "r.gguf").model_config()
    assert config.rope.freq_factors == tuple(float(f) for f in factors)
    plain = rope_inv_freq(config.head_dim, config.rope.__class__(theta=config.rope.theta))
    assert torch.allclose(rope_inv_freq(config.head_dim, config.rope), plain / torch.from_numpy(factors))


@pytest.mark.timeout(240)
def test_smollm2_weights_equal_transformers() -> None:
    """The installed real model (Q4_1, Q8_0 and F32 tensors), tensor for tensor."""
    model, _ = smollm2_reference()
    assert assert_same_tensors(smollm2_path(), dict(model.state_dict())) == 30 * 9 + 2


def test_mistral_named_files_use_llama_tensor_names(tmp_path: Path) -> None:
    model = hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", model, "F32", arch="mistral")
    config = Checkpoint.at(path).model_config()
    assert config.architecture == "MistralForCausalLM"
    assert assert_same_tensors(path, dict(model.state_dict())) == len(model.state_dict())


def test_split_files_are_refused_by_name(tmp_path: Path) -> None:
    name = tmp_path / "m-00001-of-00003.gguf"
    path = write_gguf(name, hf_model("llama"), "F16", metadata={"split.count": 3})
    with pytest.raises(ModelLoadError, match="one of 3 split GGUF files; merge them first"):
        Checkpoint.at(path).model_config()
