"""Random-weight Hugging Face reference models written to disk, and a greedy reference decoder."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 384


def _common(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(over)
    return base


def make_hf_model(kind: str, out_dir: Path, seed: int = 0, **over: Any) -> Any:
    """Write a random model of ``kind`` (llama | qwen2 | mistral) to ``out_dir``; return it
    (float32). ``over``: config fields that differ from the kind's (e.g. head counts)."""
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **_common(
                **over,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 128,
                },
                rope_theta=500000.0,
            )
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(
            **_common(**{"tie_word_embeddings": True, "num_key_value_heads": 1, **over})
        )
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**_common(**{"sliding_window": 64, "head_dim": 24, **over}))
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Wider weights than the default init, so logits are well separated and argmax is stable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    model.eval()
    model.save_pretrained(str(out_dir))
    return model


def _cache_kwarg(model: Any) -> str:
    # Newer transformers renamed ``past_key_values`` to ``cache``.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation with the reference's own KV cache; also the prompt's last logits."""
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    kw = _cache_kwarg(model)
    past = out.past_key_values
    first_logits = out.logits[0, -1].float()
    tok = int(first_logits.argmax())
    toks = [tok]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{kw: past})
        past = out.past_key_values
        tok = int(out.logits[0, -1].argmax())
        toks.append(tok)
    return toks, first_logits
