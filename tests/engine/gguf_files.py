"""Small GGUF files written at test time, laid out as llama.cpp's converter writes them.

Weights come from a random ``transformers`` model; Q and K rows are interleaved per head for the
Llama family (as the converter does), and each 2-D weight is stored in the requested type:
quantized by ``gguf.quants`` where it can, else as random blocks with finite scales (the
K-quants, which ``gguf`` only dequantizes).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")
transformers = __import__("pytest").importorskip("transformers")

Q = gguf.GGMLQuantizationType


def smollm2_path() -> Path:
    """The installed SmolLM2-135M GGUF (the test skips where its wheel is absent)."""
    from pdserve.model_runtime.errors import ModelLoadError
    from pdserve.model_runtime.presets import INSTALLED

    try:
        return INSTALLED["smollm2-135m"].path()
    except ModelLoadError as e:
        __import__("pytest").skip(str(e))


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """transformers parses the GGUF's metadata (tens of thousands of vocabulary strings, in
    Python) again for the config, the weights and the tokenizer, and rebuilds llama.cpp's
    tensor-name map for every tensor: most of a minute. Each is a pure function of its
    arguments, so the reference keeps its results and loses only the repetition."""
    with (
        mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        yield


@functools.cache
def smollm2_reference() -> tuple[Any, Any]:
    """transformers' model (float32, eval) and tokenizer of the installed SmolLM2 GGUF. Loaded
    once per test process: transformers dequantizes every tensor on load (the slowest step of
    these tests), and several modules compare against the same file. Callers must not modify them."""
    path = smollm2_path()
    with _parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# Byte offsets of the float16 scales in one block of each K-quant (ggml's block layouts).
K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def hf_model(arch: str, seed: int = 0, **over: Any) -> Any:
    """A random model whose rows are a multiple of 256 (the K-quants' block)."""
    torch.manual_seed(seed)
    cfg: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    cfg.update(over)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's per-head permutation of Q/K rows (rotate-half -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(values: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    if kind in QUANTIZABLE:
        if kind == "F32":
            return values.astype(np.float32), None
        if kind == "F16":
            return values.astype(np.float16), None
        return gguf.quants.quantize(values, Q[kind]), Q[kind]
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in K_SCALE_OFFSETS[kind]:
        scales = rng.uniform(1e-3, 2e-2, size=(rows, cols // block)).astype(np.float16)
        blocks[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return blocks.reshape(rows, -1), Q[kind]


def write_gguf(
    path: Path,
    model: Any,
    kind: str,
    arch: str = "llama",
    metadata: dict[str, Any] | None = None,
    tokens: list[str] | None = None,
    skip: frozenset[str] = frozenset(),
) -> Path:
    """``model`` as a GGUF with its 2-D weights in ``kind`` (norms stay F32)."""
    c = model.config
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH.QWEN2 if arch == "qwen2" else gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers
    )
    for name, tensor in model.state_dict().items():
        if (c.tie_word_embeddings and name == "lm_head.weight") or name in skip:
            continue
        values = tensor.detach().float().numpy()
        proj = name.rsplit(".", 2)[-2]
        if arch in ("llama", "mistral") and proj in heads:
            values = interleave(values, heads[proj])
        data, raw = encode(values, kind, rng) if values.ndim == 2 else (values, None)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
