"""Load a checkpoint's weights into ``LlamaModel``: a Hugging Face directory (``*.safetensors``,
single or sharded) or a GGUF file (``model/gguf.py``), both read as Hugging Face names.

Every failure a user can cause (wrong path, unsupported architecture, missing or corrupt shard,
wrong shape, a dtype the device cannot run) becomes a one-line ``ModelLoadError``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from pdserve.model_runtime.backend import Backend
from pdserve.model_runtime.checkpoint import Checkpoint, Format
from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.errors import ModelLoadError
from pdserve.model_runtime.model.gguf import GGUFWeights, open_gguf
from pdserve.model_runtime.model.linear import Linear, choose_backend
from pdserve.model_runtime.model.llama import LayerWeights, LlamaModel, VocabShard
from pdserve.model_runtime.parallel.group import Collectives
from pdserve.model_runtime.parallel.sharding import RankShard, rank_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``None``/"auto" means float32 on CPU and bfloat16 on CUDA."""
    if name in (None, "auto"):
        check_device(device)
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    key = _ALIASES.get(name, name)
    if key not in DTYPES:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)} or auto")
    dtype = DTYPES[key]
    check_dtype_runs(dtype, device)
    return dtype


def check_dtype_runs(dtype: torch.dtype, device: torch.device) -> None:
    """Run the kernels a forward pass needs once; any failure becomes a one-line error."""
    check_device(device)
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ModelLoadError(f"dtype bfloat16 cannot run on {torch.cuda.get_device_name(device)}")
    try:
        a = torch.ones(4, 8, dtype=dtype, device=device)
        torch.nn.functional.scaled_dot_product_attention(a[None, None], a[None, None], a[None, None])
        torch.nn.functional.linear(a, a)
    except Exception as e:  # backends raise RuntimeError, NotImplementedError or AssertionError
        raise ModelLoadError(f"dtype {dtype} cannot run on device {device}: {e}") from None


def check_device(device: torch.device) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device} requested, but this torch build sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device} requested, but only {torch.cuda.device_count()} GPU(s) exist"
            )
    elif device.type != "cpu":
        raise ModelLoadError(f"device type {device.type!r} is not supported (cpu or cuda)")


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: corrupt shard index ({e})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(
                f"{model_dir}: shard(s) listed in the index are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files")
    return files


class WeightSource(Protocol):
    """Tensors by Hugging Face name; ``get`` checks the shape and raises ``ModelLoadError``."""

    def has(self, name: str) -> bool: ...

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor: ...


class _Tensors:
    """Name -> lazily read tensor across safetensors shards."""

    def __init__(self, files: list[Path], stack: ExitStack) -> None:
        self._where: dict[str, Any] = {}
        for f in files:
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
            except (SafetensorError, OSError, ValueError) as e:
                raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({e})") from None
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                self._where[name] = (handle, f)

    def names(self) -> Iterator[str]:
        return iter(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
        handle, f = self._where[name]
        try:
            t: torch.Tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{f}: cannot read {name!r} ({e})") from None
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(t.shape)}, config.json implies {shape}")
        return t


def check_checkpoint(checkpoint: Checkpoint) -> ModelConfig:
    """What can be checked without reading the weights: the configuration and, for a Hugging
    Face directory, that its weight files are all there. ``pdserve serve`` runs this before
    starting any worker, so a wrong path or config fails in a second with its own message."""
    config = checkpoint.model_config()
    if checkpoint.format is Format.HF:
        _weight_files(checkpoint.path)
    return config


class _RandomWeights:
    """Weights of the right shapes and no checkpoint: N(0, 0.02) matrices, unit norms, zero
    biases, made on the target device. Speed does not depend on weight values, so a model this
    size measures what a real one of its shape would, without the 16 GB file."""

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int, tied: bool) -> None:
        self.device = device
        self.dtype = dtype
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.tied = tied

    def has(self, name: str) -> bool:
        return not (self.tied and name.startswith("lm_head"))

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        if name.endswith("bias"):
            return torch.zeros(shape, device=self.device, dtype=self.dtype)
        t = torch.randn(shape, device=self.device, dtype=self.dtype, generator=self.gen)
        return t.mul_(0.02)


def random_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    engine_backend: Backend = Backend.TORCH,
    seed: int = 0,
    tp: TPRank | None = None,
) -> LlamaModel:
    """A model of ``config``'s shape with random weights (benchmarks of a shape, not of a model).
    Made whole and then sliced, so a rank's shard equals the TP 1 model's part."""
    weights = _RandomWeights(device, dtype, seed, config.tie_word_embeddings)
    return _build(config, weights, device, dtype, max_positions, engine_backend, tp)


def load_model(
    checkpoint: Checkpoint,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    engine_backend: Backend = Backend.TORCH,
    tp: TPRank | None = None,
) -> LlamaModel:
    """``checkpoint``'s weights as the model ``config`` (its ``model_config()``, which the caller
    has already read to size the KV cache) describes; with ``tp``, that rank's shard of them."""
    with ExitStack() as stack:
        w: WeightSource
        if checkpoint.format is Format.GGUF:
            w = GGUFWeights(open_gguf(checkpoint.path), config)
        else:
            w = _Tensors(_weight_files(checkpoint.path), stack)
        return _build(config, w, device, dtype, max_positions, engine_backend, tp)


class TPRank:
    """One rank of a tensor-parallel worker: which slices it loads and the group it reduces in."""

    def __init__(self, shard: RankShard, group: Collectives) -> None:
        self.shard, self.group = shard, group


def _build(
    c: ModelConfig,
    w: WeightSource,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    engine_backend: Backend = Backend.TORCH,
    tp: TPRank | None = None,
) -> LlamaModel:
    h, inter = c.hidden_size, c.intermediate_size
    s = tp.shard if tp is not None else None
    d = c.head_dim
    # A rank's slices: query heads, KV heads, MLP rows; full ranges without a shard.
    qh = s.q_heads if s is not None else (0, c.num_heads)
    kvh = s.kv_heads if s is not None else (0, c.num_kv_heads)
    mlp = s.intermediate if s is not None else (0, inter)
    first = s is None or s.rank == 0  # row-parallel biases are added once, on rank 0

    def heads(t: torch.Tensor, r: tuple[int, int], dim: int = 0) -> torch.Tensor:
        return t if s is None else t.narrow(dim, r[0] * d, r[1] * d)

    def part(t: torch.Tensor, r: tuple[int, int], dim: int = 0) -> torch.Tensor:
        return t if s is None else t.narrow(dim, r[0], r[1])

    def vocab_rows(t: torch.Tensor) -> torch.Tensor:
        """This rank's embedding / head rows, zero-padded to the common row count."""
        if s is None:
            return t
        rows = t.narrow(0, s.vocab[0], s.vocab[1])
        pad = s.vocab_rows - s.vocab[1]
        return rows if pad == 0 else torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))

    def to_dev(*ts: torch.Tensor) -> torch.Tensor:
        out = ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)
        return out.to(device=device, dtype=dtype).contiguous()

    backend = choose_backend(device, dtype)

    def linear(weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...] | None) -> Linear:
        """Checkpoint [out, in] matrices, concatenated along ``out``, as one projection."""
        return Linear(to_dev(*weights), to_dev(*biases) if biases else None, backend)

    embed = to_dev(vocab_rows(w.get("model.embed_tokens.weight", (c.vocab_size, h))))
    layers: list[LayerWeights] = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        m = p + "mlp."
        layers.append(
            LayerWeights(
                input_norm=to_dev(w.get(p + "input_layernorm.weight", (h,))),
                qkv=linear(
                    (
                        heads(w.get(a + "q_proj.weight", (c.q_size, h)), qh),
                        heads(w.get(a + "k_proj.weight", (c.kv_size, h)), kvh),
                        heads(w.get(a + "v_proj.weight", (c.kv_size, h)), kvh),
                    ),
                    (
                        heads(w.get(a + "q_proj.bias", (c.q_size,)), qh),
                        heads(w.get(a + "k_proj.bias", (c.kv_size,)), kvh),
                        heads(w.get(a + "v_proj.bias", (c.kv_size,)), kvh),
                    )
                    if c.qkv_bias
                    else None,
                ),
                o=linear(
                    (heads(w.get(a + "o_proj.weight", (h, c.q_size)), qh, dim=1),),
                    (_zeroed(w.get(a + "o_proj.bias", (h,)), first),) if c.o_bias else None,
                ),
                post_norm=to_dev(w.get(p + "post_attention_layernorm.weight", (h,))),
                gate_up=linear(
                    (
                        part(w.get(m + "gate_proj.weight", (inter, h)), mlp),
                        part(w.get(m + "up_proj.weight", (inter, h)), mlp),
                    ),
                    (
                        part(w.get(m + "gate_proj.bias", (inter,)), mlp),
                        part(w.get(m + "up_proj.bias", (inter,)), mlp),
                    )
                    if c.mlp_bias
                    else None,
                ),
                down=linear(
                    (part(w.get(m + "down_proj.weight", (h, inter)), mlp, dim=1),),
                    (_zeroed(w.get(m + "down_proj.bias", (h,)), first),) if c.mlp_bias else None,
                ),
            )
        )
    final_norm = to_dev(w.get("model.norm.weight", (h,)))
    if c.tie_word_embeddings or not w.has("lm_head.weight"):
        if not c.tie_word_embeddings:
            raise ModelLoadError("weight 'lm_head.weight' is missing and tie_word_embeddings is false")
        lm_head = Linear(embed, None, backend)
    else:
        lm_head = linear((vocab_rows(w.get("lm_head.weight", (c.vocab_size, h))),), None)
    if tp is None or s is None:
        return LlamaModel(c, embed, layers, final_norm, lm_head, max_positions, engine_backend)
    vocab = VocabShard(s.vocab[0], s.vocab[1], s.vocab_rows, c.vocab_size)
    return LlamaModel(
        rank_config(c, s), embed, layers, final_norm, lm_head, max_positions, engine_backend, tp.group, vocab
    )


def _zeroed(bias: torch.Tensor, keep: bool) -> torch.Tensor:
    """A row-parallel projection's bias: kept on one rank, zero on the others, so the
    all-reduce adds it once."""
    return bias if keep else torch.zeros_like(bias)
