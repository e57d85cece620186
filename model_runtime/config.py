"""Model and cache configuration as frozen data (pure Python).

``ModelConfig.from_hf`` reads a Hugging Face ``config.json`` of the Llama family (Llama, Qwen2,
Mistral), accepting both the ``rope_scaling`` form of older checkpoints and the
``rope_parameters`` form written by newer ``transformers``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.model_runtime.backend import check_overlap
from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.sampling_params import MAX_LOGPROBS_DEFAULT
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from pdserve.steptime.load import load_profile
from pdserve.steptime.model import StepTimeModel
from pdserve.steptime.parallel import at_degree
from pdserve.steptime.roofline import TP_DEGREES

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
POSITIVE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Per-frequency divisors stored beside the weights (GGUF ``rope_freqs``), applied after the
    # type's own scaling; empty: none.
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k, v only
    o_bias: bool = False  # Llama ``attention_bias``: bias on q, k, v and o
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @staticmethod
    def from_file(path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(
                f"{path.parent}: no config.json (not a Hugging Face model directory)"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return ModelConfig.from_hf(raw, source=str(path))

    @staticmethod
    def from_hf(raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def req(key: str) -> Any:
            if key not in raw:
                raise ModelLoadError(f"{source}: missing required field {key!r}")
            return raw[key]

        for key in POSITIVE_FIELDS:
            value = raw.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")

        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"{source}: unsupported hidden_act {act!r} (only silu)")
        num_heads = int(req("num_attention_heads"))
        hidden = int(req("hidden_size"))
        num_kv = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        if num_heads % num_kv:
            raise ModelLoadError(
                f"{source}: num_attention_heads {num_heads} not a multiple of {num_kv} KV heads"
            )

        rope = _parse_rope(raw, source)
        sliding = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM":
            if raw.get("use_sliding_window"):
                raise ModelLoadError(f"{source}: Qwen2 use_sliding_window=true is not supported")
            sliding = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        is_qwen = arch == "Qwen2ForCausalLM"
        return ModelConfig(
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=int(req("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen or bool(raw.get("attention_bias", False)),
            o_bias=(not is_qwen) and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _parse_rope(raw: Mapping[str, Any], source: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if v is not None})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factor = float(params.get("factor", 1.0))
    if not math.isfinite(factor) or factor <= 0:
        raise ModelLoadError(f"{source}: rope factor must be positive, got {factor}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


CPU_KV_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape.

    The pool is ``num_blocks`` blocks when that is set; else ``memory_budget_bytes`` of them;
    else (0, the default) sized by device: ``CPU_KV_BUDGET_BYTES`` on a CPU, and on a GPU what is
    free once the weights are loaded, less a reserve for the step's activations and graphs
    (``backend.kv_blocks_for_free_memory``).
    """

    block_size: int = 16
    num_blocks: int = 0
    memory_budget_bytes: int = 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_blocks < 0 or self.memory_budget_bytes < 0:
            raise ValueError(f"block_size must be positive and the pool's sizes non-negative: {self}")

    def block_bytes(self, model: ModelConfig, dtype_bytes: int) -> int:
        return model.kv_bytes_per_token(dtype_bytes) * self.block_size

    def resolve_num_blocks(self, model: ModelConfig, dtype_bytes: int, free_blocks: int | None = None) -> int:
        """Blocks in the pool; ``free_blocks``: what fits in free device memory (GPU workers)."""
        if self.num_blocks > 0:
            return self.num_blocks
        if self.memory_budget_bytes == 0 and free_blocks is not None:
            return max(1, free_blocks)
        budget = self.memory_budget_bytes or CPU_KV_BUDGET_BYTES
        return max(1, budget // self.block_bytes(model, dtype_bytes))


COMPUTE_MODES = ("model", "zero", "emulated:<profile>")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # preset name or Hugging Face directory
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str | None = None  # None/auto: float32 on CPU, bfloat16 on CUDA
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_num_batched_tokens=512))
    max_logprobs: int = MAX_LOGPROBS_DEFAULT
    compute: str = "model"  # "zero": no model math, deterministic tokens (serving-path benchmarks)
    step_log: str = ""  # a directory: each worker logs its steps there (``engine.step_log``); "" off
    backend: str = "auto"  # auto | torch | paged (``backend.choose_backend``)
    cuda_graphs: bool = True  # paged backend on CUDA: replay decode steps from captured graphs
    overlap: str = "auto"  # auto | on | off: plan a decode step while one runs (``backend.use_overlap``)
    tp: int = 1  # tensor-parallel degree: ranks (GPUs, or CPU processes) of one worker
    tp_timeout_s: float = 30.0  # a collective that waits longer fails the worker (a rank died or stalls)

    def __post_init__(self) -> None:
        if self.tp not in TP_DEGREES:
            raise ValueError(f"tensor-parallel degree must be one of {TP_DEGREES}, got {self.tp}")
        if not 0 < self.tp_timeout_s < float("inf"):
            raise ValueError(f"tp_timeout_s must be a positive number of seconds, got {self.tp_timeout_s}")
        if self.compute not in ("model", "zero") and not self.compute.startswith("emulated:"):
            raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {self.compute!r}")
        profile = self.profile  # an unknown profile fails here, before any worker starts
        if profile is not None:
            _ = profile.kv_capacity_tokens  # as does a tensor-parallel degree it does not fit at
        check_overlap(self.overlap)

    @property
    def profile(self) -> StepTimeModel | None:
        """The emulated GPU worker's step-time model, at this engine's degree when it is > 1
        (a profile named ``…@tpN`` keeps its own otherwise)."""
        if not self.compute.startswith("emulated:"):
            return None
        return at_degree(load_profile(self.compute.split(":", 1)[1]), self.tp)
