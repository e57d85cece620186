from __future__ import annotations

import math

import pytest

from pdserve.model_runtime.errors import InvalidRequestError
from pdserve.model_runtime.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": -3}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": math.nan}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -2}),
        ("top_k", {"top_k": 7099240947077430116352}),  # past any wire format: was a 500
        ("seed", {"seed": 2**64}),
        ("seed", {"seed": -(2**63) - 1}),
        ("min_p", {"min_p": 1.1}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("frequency_penalty", {"frequency_penalty": 3.0}),
        ("presence_penalty", {"presence_penalty": -2.5}),
        ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
        ("stop_token_ids", {"stop_token_ids": (1000,)}),
        ("logprobs", {"logprobs": 50}),
        ("logprobs", {"logprobs": -1}),
        ("stop", {"stop": ("",)}),
    ],
)
def test_invalid_values_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs).validate(vocab_size=100)  # type: ignore[arg-type]
    assert e.value.field == field


def test_the_widest_integers_the_wire_carries_are_valid() -> None:
    for kw in ({"top_k": 2**31 - 1}, {"seed": 2**64 - 1}, {"seed": -(2**63)}):
        SamplingParams(max_tokens=4, **kw).validate(vocab_size=1000)  # type: ignore[arg-type]


def test_defaults_and_create_are_valid() -> None:
    SamplingParams().validate(100)
    p = SamplingParams.create(stop="x", stop_token_ids=[3], max_tokens=4)
    assert p.stop == ("x",) and p.stop_token_ids == (3,)
    p.validate(100)


@pytest.mark.parametrize("bad", [-1, 1000, True, 3.0, "7", None, 2**64])
def test_a_prompt_token_outside_the_vocabulary_is_named(bad: object) -> None:
    from pdserve.model_runtime.validation import RequestLimits, validate_request

    limits = RequestLimits(vocab_size=1000, max_model_len=4096, block_size=16, kv_capacity_blocks=1000)
    validate_request((0, 5, 999), SamplingParams(max_tokens=4), limits)
    with pytest.raises(InvalidRequestError, match=f"token id {bad!r} is outside the vocabulary"):
        validate_request((1, 2, bad, 3), SamplingParams(max_tokens=4), limits)  # type: ignore[arg-type]


def test_checked_tokens_are_checked_once_and_only_against_a_vocabulary_as_large(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdserve.model_runtime import validation
    from pdserve.model_runtime.validation import RequestLimits, checked_tokens, validate_request

    with pytest.raises(InvalidRequestError, match="prompt"):
        checked_tokens((1, 2000), vocab=1000)
    prompt = checked_tokens((1, 900, 3), vocab=1000)
    assert prompt == (1, 900, 3) and prompt[1:] == (900, 3)
    calls: list[int] = []
    real = validation._check_token_ids
    monkeypatch.setattr(
        validation, "_check_token_ids", lambda ids, vocab: calls.append(vocab) or real(ids, vocab)
    )
    validate_request(prompt, SamplingParams(max_tokens=4), RequestLimits(1000, 64, 16, 100))
    validate_request(prompt, SamplingParams(max_tokens=4), RequestLimits(4000, 64, 16, 100))
    assert calls == []  # checked against 1,000 ids: good for any vocabulary as large
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        validate_request(prompt, SamplingParams(max_tokens=4), RequestLimits(500, 64, 16, 100))
    validate_request((1, 900, 3), SamplingParams(max_tokens=4), RequestLimits(1000, 64, 16, 100))
    assert calls == [500, 1000]  # a smaller vocabulary, and a plain tuple, are checked
