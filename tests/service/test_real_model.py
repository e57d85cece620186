"""The default model, SmolLM2-135M-Instruct from its wheel's GGUF, through the disaggregated
service (1 prefill + 1 decode on real Ray, KV over shared memory): greedy tokens and chat prompts
equal transformers loading the same file."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from pdserve.deploy.service import Endpoints, ServiceThread
from pdserve.model_runtime.config import CacheConfig
from pdserve.model_runtime.scheduler.plan import SchedulerConfig
from tests.engine.gguf_files import smollm2_reference
from tests.engine.hf_models import hf_greedy
from tests.engine.test_gguf_tokenizer import CONVERSATIONS
from tests.service.helpers import running_service

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "Disaggregated serving splits prefill and decode because",
    "1, 2, 3, 4, 5,",
    "The three primary colours are",
    "Q: What is the boiling point of water?\nA:",
    "Once upon a time, in a small village,",
]
TOKENS = 32  # per prompt: the reference decodes each prompt alone, which is most of this module's time


@pytest.fixture(scope="module")
def reference() -> Any:
    return smollm2_reference()


@pytest.fixture(scope="module")
def service(reference: Any) -> Iterator[tuple[ServiceThread, Endpoints]]:
    with running_service(
        use_ray=True,
        transport="shm",
        model=MODEL,
        cache=CacheConfig(block_size=16, num_blocks=192),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16),
    ) as running:
        yield running


def post(ep: Endpoints, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{ep.http}{path}", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def test_greedy_tokens_equal_transformers(service: tuple[ServiceThread, Endpoints], reference: Any) -> None:
    _, ep = service
    model, _ = reference
    out = post(ep, "/v1/completions", {"prompt": PROMPTS, "max_tokens": TOKENS, "temperature": 0,
                                       "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert len(out["choices"]) == len(PROMPTS)
    with torch.no_grad():
        for choice in out["choices"]:
            expected, _ = hf_greedy(model, choice["prompt_token_ids"], TOKENS)
            assert choice["token_ids"] == expected, PROMPTS[choice["index"]]


def test_chat_prompt_ids_equal_apply_chat_template(
    service: tuple[ServiceThread, Endpoints], reference: Any
) -> None:
    _, ep = service
    _, tokenizer = reference
    for conversation in CONVERSATIONS:
        out = post(
            ep, "/v1/chat/completions", {"messages": conversation, "max_tokens": 1, "return_token_ids": True}
        )
        expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        expected = list(expected if isinstance(expected, list) else expected["input_ids"])
        assert out["choices"][0]["prompt_token_ids"] == expected, conversation


def test_chat_answers_the_question(service: tuple[ServiceThread, Endpoints]) -> None:
    _, ep = service
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = post(ep, "/v1/chat/completions", {"messages": question, "max_tokens": 32, "temperature": 0})
    answer = out["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    assert out["choices"][0]["finish_reason"] == "stop"  # <|im_end|>, the model's EOS


# -- structured output and tool calls through the official client (issue 60) ------------------
class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)


class GetWeather(BaseModel):
    """Look up the current weather in a city."""

    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


def client(ep: Endpoints) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{ep.http}/v1", api_key="unused", timeout=120)


ASK_CITY = [{"role": "user", "content": "Describe Paris as JSON: its name, country and population."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_parse_with_a_pydantic_model(service: tuple[ServiceThread, Endpoints]) -> None:
    c = client(service[1])
    done = c.beta.chat.completions.parse(
        model=MODEL,
        messages=ASK_CITY,
        response_format=City,
        max_tokens=64,
        temperature=0,  # type: ignore[arg-type]
    )
    city = done.choices[0].message.parsed
    assert isinstance(city, City), done
    assert done.choices[0].finish_reason == "stop"
    with c.beta.chat.completions.stream(
        model=MODEL,
        messages=ASK_CITY,
        response_format=City,
        max_tokens=64,
        temperature=0,  # type: ignore[arg-type]
    ) as stream:
        streamed = stream.get_final_completion().choices[0].message.parsed
    assert streamed == city  # greedy: the same answer streamed


def test_tools_with_tool_choice_required(service: tuple[ServiceThread, Endpoints]) -> None:
    c = client(service[1])
    tools = [openai.pydantic_function_tool(GetWeather)]
    done = c.beta.chat.completions.parse(
        model=MODEL, messages=ASK_WEATHER, tools=tools, tool_choice="required",  # type: ignore[arg-type]
        max_tokens=96, temperature=0,
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls and all(call.function.name == "GetWeather" for call in calls)
    args = [call.function.parsed_arguments for call in calls]
    assert all(isinstance(a, GetWeather) for a in args), args
    with c.beta.chat.completions.stream(
        model=MODEL, messages=ASK_WEATHER, tools=tools, tool_choice="required",  # type: ignore[arg-type]
        max_tokens=96, temperature=0,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [call.function.parsed_arguments for call in final.message.tool_calls or []] == args
