"""A streamed completion's logprobs are the whole response's, however the stream is cut into chunks."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from pdserve.model_runtime.request import Usage
from pdserve.router.openai_format import ChoiceBuilder
from pdserve.router.stream import Chunk, Final, Timing
from pdserve.worker.messages import Logprob

IDS = (5, 17, 123, 9, 40)
LPS = tuple(Logprob(t, -0.1 * i, ((t, -0.1 * i), (t + 1, -3.0))) for i, t in enumerate(IDS))
FINAL = Final("r", "length", None, Usage(2, 5, 0), Timing(0, 1, 1, 5), "p", "d", (1, 2), IDS, None)


def chunks(cuts: list[int]) -> list[Chunk]:
    bounds = [0, *cuts, len(IDS)]
    return [Chunk(IDS[a:b], "", LPS[a:b]) for a, b in itertools.pairwise(bounds)]


def streamed(cuts: list[int]) -> dict[str, list[Any]]:
    b = ChoiceBuilder(None, "cmpl-1", chat=False, return_token_ids=True, model="m", num_choices=1)
    out: dict[str, list[Any]] = {}
    for c in chunks(cuts):
        for key, values in b.stream_chunk(0, c)["choices"][0]["logprobs"].items():
            out.setdefault(key, []).extend(values)
    return out


@pytest.mark.parametrize("cuts", [[1, 2, 3, 4], [2], [1, 4], []])
def test_streamed_logprobs_join_into_the_whole_responses(cuts: list[int]) -> None:
    whole = ChoiceBuilder(None, "cmpl-1", chat=False, return_token_ids=True, model="m", num_choices=1)
    for c in chunks([]):
        whole.add(0, c)
    whole.add(0, FINAL)
    expected = whole.response()["choices"][0]["logprobs"]
    assert expected["text_offset"] == [0, 10, 21, 33, 43]  # "token_id:5" is 10 characters, ...
    assert streamed(cuts) == expected
