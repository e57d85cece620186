"""Generation defaults: what a checkpoint recommends fills only what a request leaves unset."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.model_runtime.generation_config import (
    GenerationConfig,
    GenerationDefaults,
    gguf_generation_config,
    merged,
    read_generation_config,
)
from pdserve.router.config import Caps
from pdserve.router.grpc_api import sampling_params as grpc_sampling_params
from pdserve.router.openai_models import CompletionRequest
from pdserve.v1 import inference_pb2 as pb

MODEL = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=50, repetition_penalty=1.1, max_tokens=256)


def test_read_generation_config_json(tmp_path: Path) -> None:
    raw = {"eos_token_id": [128001, 128009], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    raw |= {"top_k": 50.0, "max_new_tokens": 512, "min_p": "high", "repetition_penalty": float("nan")}
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    cfg = read_generation_config(tmp_path)
    assert cfg.eos_token_ids == (128001, 128009)
    assert cfg.defaults == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=50, max_tokens=512)
    assert cfg.source.endswith("generation_config.json")


@pytest.mark.parametrize("content", ["", "not json", "[1, 2]", '{"eos_token_id": true}'])
def test_a_bad_generation_config_says_nothing(tmp_path: Path, content: str) -> None:
    (tmp_path / "generation_config.json").write_text(content)
    cfg = read_generation_config(tmp_path)
    assert cfg.eos_token_ids == () and cfg.defaults == GenerationDefaults()
    assert read_generation_config(tmp_path / "absent") == GenerationConfig()


def test_gguf_end_of_generation_ids_and_sampling_keys() -> None:
    cfg = gguf_generation_config(
        {"tokenizer.ggml.eos_token_id": 128001, "tokenizer.ggml.eot_token_id": 128009,
         "tokenizer.ggml.eom_token_id": 128008, "general.sampling.temp": 0.7, "general.sampling.top_k": 40},
        "m.gguf",
    )  # fmt: skip
    assert cfg.eos_token_ids == (128001, 128009, 128008)
    assert cfg.defaults == GenerationDefaults(temperature=0.7, top_k=40)
    beside = GenerationConfig((7,), GenerationDefaults(temperature=0.2), "generation_config.json")
    both = merged(beside, cfg)
    assert both.eos_token_ids == (7, 128001, 128009, 128008)
    assert both.defaults == GenerationDefaults(temperature=0.2, top_k=40)


@given(
    temperature=st.none() | st.floats(0, 2),
    top_k=st.none() | st.integers(-1, 100),
    max_tokens=st.none() | st.integers(1, 10_000),
)
def test_request_values_always_win(
    temperature: float | None, top_k: int | None, max_tokens: int | None
) -> None:
    caps = Caps(max_tokens=4096, default_max_tokens=16)
    out = caps.with_defaults(MODEL, {"temperature": temperature, "top_k": top_k, "min_p": None}, max_tokens)
    assert out["temperature"] == (0.6 if temperature is None else temperature)
    assert out["top_k"] == (50 if top_k is None else top_k)
    assert out["top_p"] == 0.9 and out["repetition_penalty"] == 1.1
    assert "min_p" not in out  # neither said: SamplingParams' own default applies
    assert out["max_tokens"] == (256 if max_tokens is None else max_tokens)


def test_model_max_new_tokens_is_held_to_the_cap() -> None:
    caps = Caps(max_tokens=100, default_max_tokens=16)
    assert caps.with_defaults(MODEL, {}, None)["max_tokens"] == 100
    assert caps.with_defaults(GenerationDefaults(), {}, None)["max_tokens"] == 16


def test_http_and_grpc_apply_the_same_defaults() -> None:
    caps = Caps()
    body = CompletionRequest(model="m", prompt="x", top_p=0.5)
    http = body.sampling_params(caps, body.max_tokens, body.logprobs, MODEL)
    grpc = grpc_sampling_params(pb.SamplingParameters(top_p=0.5), caps, MODEL)
    assert http == grpc
    assert (http.temperature, http.top_p, http.top_k, http.max_tokens) == (0.6, 0.5, 50, 256)
    # An explicit zero is a value, not "unset".
    greedy = grpc_sampling_params(pb.SamplingParameters(temperature=0.0, top_k=0), caps, MODEL)
    assert greedy.temperature == 0.0 and greedy.top_k == 0
    plain = CompletionRequest(model="m", prompt="x").sampling_params(caps, None, None)
    assert plain.temperature == 1.0 and plain.max_tokens == caps.default_max_tokens
    assert math.isclose(plain.top_p, 1.0)


def test_checkpoint_values_a_request_could_not_set_are_dropped(tmp_path: Path) -> None:
    raw = {"top_p": 0, "max_new_tokens": 0, "temperature": -1.0, "top_k": -5, "min_p": 2.0}
    raw["repetition_penalty"] = 0
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    assert read_generation_config(tmp_path).defaults == GenerationDefaults()


def test_gguf_control_tokens_that_end_a_turn_stop_generation() -> None:
    # <|im_end|> (id 4) is not a control token in this vocabulary: plain text, not a stop.
    control = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 3: "<|eot_id|>"}
    cfg = gguf_generation_config({"tokenizer.ggml.eos_token_id": 1}, "m.gguf", control)
    assert cfg.eos_token_ids == (1, 3)
