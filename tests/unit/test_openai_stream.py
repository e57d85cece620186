"""Streamed OpenAI events: a completion's logprobs are the whole response's however the stream
is cut into chunks, and each chunk's event is exactly its object's JSON."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=300, deadline=None)
@given(
    chat=st.booleans(),
    return_ids=st.booleans(),
    n=st.integers(1, 3),
    text=st.text(),
    ids=st.lists(st.integers(0, 2**31), max_size=8),
    rid=st.text(max_size=12),
)
def test_a_streamed_chunk_is_the_bytes_of_its_json_object(
    chat: bool, return_ids: bool, n: int, text: str, ids: list[int], rid: str
) -> None:
    """The pieces encoded once per response give, byte for byte, what encoding the whole
    object gives (quotes, escapes, any characters in the text, the id and the model name)."""
    b = ChoiceBuilder(
        None, f"cmpl-{rid}", chat=chat, return_token_ids=return_ids, model=f'm"{rid}', num_choices=n
    )
    twin = copy.deepcopy(b)  # (streaming logprobs moves a choice's text offset on)
    for i in range(n):
        for ev in (Chunk(tuple(ids), text, None), Chunk(tuple(ids), text, LPS[:1]), FINAL):
            obj = twin.stream_chunk(i, ev)
            event = b.stream_event(i, ev)
            compact = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
            assert event == b"data: " + compact.encode() + b"\n\n"
