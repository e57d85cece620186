"""GGUF checkpoints (llama.cpp's single-file format) read with the ``gguf`` package.

A GGUF file holds the model's shape, its tokenizer and chat template as metadata, and its
tensors, often quantized. ``GGUFFile`` turns the metadata into the same ``ModelConfig`` a
``config.json`` gives, and ``GGUFWeights`` serves tensors under their Hugging Face names and in
their Hugging Face layout, dequantized to float32 by ``gguf.quants`` (the loader then casts to
the runtime's dtype):

- llama.cpp's converter interleaves the two rotary halves of every Q and K head for the Llama
  family (``llama``, ``mistral``); the rows are put back in rotate-half order here. Qwen2 is
  stored unpermuted.
- ``rope_freqs.weight`` (Llama 3.1 files) divides each rotary frequency; it becomes
  ``RopeConfig.freq_factors``.

Every failure (not a GGUF file, an architecture or quantization type we do not run, a missing
tensor) is a one-line ``ModelLoadError`` naming it.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.errors import ModelLoadError

# GGUF's architecture name -> the Hugging Face class whose layout our model implements.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_PERMUTED_QK = ("llama", "mistral")
QUANT_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of the rotary halves (rows of a Q/K weight or bias)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFFile:
    """One open GGUF file: metadata by key, tensors by GGUF name (memory-mapped)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader  # the package is imported only where a GGUF is read

        self.path = path
        try:
            self._reader = GGUFReader(path)
        except (ValueError, OSError, IndexError, KeyError) as e:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        splits = self.value("split.count", 1)
        if isinstance(splits, int) and splits > 1:
            raise ModelLoadError(
                f"{path}: one of {splits} split GGUF files; merge them first (llama.cpp's gguf-split --merge)"
            )
        self.architecture = str(self.value("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: unsupported GGUF architecture {self.architecture!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )

    def value(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.architecture}.{key}", default)

    def tokens_of_type(self, kind: int) -> dict[int, str]:
        """The vocabulary's tokens of one llama.cpp token type (``gguf.TokenType``), by id."""
        tokens = self.value("tokenizer.ggml.tokens") or []
        types = self.value("tokenizer.ggml.token_type") or []
        return {i: t for i, (t, k) in enumerate(zip(tokens, types, strict=False)) if k == kind}

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (GGUF naming) dequantized to float32, rows first as PyTorch stores it."""
        from gguf import GGMLQuantizationType, quants

        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        kind = GGMLQuantizationType(t.tensor_type)
        if kind.name not in QUANT_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} uses quantization type {kind.name}, which is not "
                f"supported; supported: {', '.join(QUANT_TYPES)}"
            )
        try:
            values = quants.dequantize(t.data, kind)
        except (ValueError, NotImplementedError) as e:
            raise ModelLoadError(f"{self.path}: cannot dequantize {name!r} ({kind.name}: {e})") from None
        # GGUF lists dimensions innermost first; PyTorch's shape is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        # Quantized types come back as a new float32 array (used as is); F32 as a read-only view
        # of the memory-mapped file (copied: the model owns its weights).
        return torch.from_numpy(np.require(values, np.float32, ["C", "W"]).reshape(shape))

    def model_config(self) -> ModelConfig:
        """The model's shape as ``ModelConfig.from_hf`` would read it from a ``config.json``."""
        heads = self.arch_value("attention.head_count")
        kv_heads = self.arch_value("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            if len(set(kv_heads)) != 1:
                raise ModelLoadError(f"{self.path}: a KV head count per layer is not supported")
            kv_heads = kv_heads[0]
        hidden = self.arch_value("embedding_length")
        vocab = self.arch_value("vocab_size")
        if vocab is None:
            tokens = self._reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else None
        raw: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self.arch_value("feed_forward_length"),
            "num_hidden_layers": self.arch_value("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": self.arch_value("context_length", 4096),
            "rms_norm_eps": self.arch_value("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.arch_value("rope.freq_base", 10000.0),
            "tie_word_embeddings": not self.has_tensor("output.weight"),
            "attention_bias": self.architecture != "qwen2" and self.has_tensor("blk.0.attn_q.bias"),
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.value("tokenizer.ggml.eos_token_id"),
        }
        raw = {k: v for k, v in raw.items() if v is not None}
        key_length = self.arch_value("attention.key_length")
        if key_length is not None:
            raw["head_dim"] = key_length
        window = self.arch_value("attention.sliding_window")
        if window and self.architecture == "mistral":
            raw["sliding_window"] = window
        scaling = self.arch_value("rope.scaling.type")
        if scaling not in (None, "none"):
            raw["rope_scaling"] = {
                "rope_type": scaling,
                "factor": self.arch_value("rope.scaling.factor", 1.0),
            }
        config = ModelConfig.from_hf(raw, source=str(self.path))
        if self.has_tensor("rope_freqs.weight"):
            factors = tuple(float(f) for f in self.read("rope_freqs.weight").tolist())
            if len(factors) != config.head_dim // 2:
                raise ModelLoadError(
                    f"{self.path}: rope_freqs has {len(factors)} entries, expected {config.head_dim // 2}"
                )
            config = replace(config, rope=replace(config.rope, freq_factors=factors))
        return config


def open_gguf(path: Path) -> GGUFFile:
    """Parsing the metadata takes seconds for a large vocabulary; config, tokenizer and weights
    are read from one parse (a file rewritten in place is parsed again)."""
    try:
        stat = path.stat()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror})") from None
    return _open_gguf(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=2)
def _open_gguf(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


class GGUFWeights:
    """Tensors of a GGUF file under their Hugging Face names (the loader's weight source)."""

    def __init__(self, file: GGUFFile, config: ModelConfig) -> None:
        import gguf

        self.file = file
        self._heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
        # llama.cpp writes Mistral models as "llama"; a file that says "mistral" uses its names.
        name = "llama" if file.architecture == "mistral" else file.architecture
        arch = {arch_name: arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items()}[name]
        # The gguf package's own table of Hugging Face -> GGUF tensor names (llama.cpp's).
        self._names = gguf.get_tensor_name_map(arch, config.num_layers)

    def gguf_name(self, name: str) -> str | None:
        """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``."""
        found = self._names.get_name(name, try_suffixes=(".weight", ".bias"))
        return None if found is None else str(found)

    def has(self, name: str) -> bool:
        found = self.gguf_name(name)
        return found is not None and self.file.has_tensor(found)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        found = self.gguf_name(name)
        if found is None:
            raise ModelLoadError(f"{self.file.path}: no GGUF tensor name for weight {name!r}")
        t = self.file.read(found)
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                f"{self.file.path}: weight {name!r} has shape {tuple(t.shape)}, the metadata implies {shape}"
            )
        proj = name.rsplit(".", 2)[-2]
        if self.file.architecture in _PERMUTED_QK and proj in self._heads:
            t = unpermute_rows(t, self._heads[proj])
        return t
