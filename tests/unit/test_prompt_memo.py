"""Per-prompt work done once (``pdserve.simulator.prompt_memo``): the same answers, computed
once per prompt object."""

from __future__ import annotations

import pytest

from pdserve.model_runtime.validation import CheckedTokens
from pdserve.router.prefix import block_keys
from pdserve.simulator import prompt_memo


def test_a_prompt_is_checked_and_hashed_once_per_object(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    monkeypatch.setattr(prompt_memo, "block_keys", lambda p, bs: hashed.append(len(p)) or block_keys(p, bs))
    a = tuple(range(100))
    twin = tuple(range(100))  # equal, another object: answered afresh (and the same)
    first = prompt_memo.checked(a)
    assert type(first) is CheckedTokens and first == a
    assert prompt_memo.checked(a) is first and prompt_memo.checked(twin) is not first
    assert prompt_memo.prompt_keys(first, 16) == block_keys(a, 16) == prompt_memo.prompt_keys(first, 16)
    assert prompt_memo.prompt_keys(first, 32) == block_keys(a, 32)
    assert hashed == [100, 100]  # once per (prompt, block size)


def test_a_prompts_blocks_are_cut_once_per_object() -> None:
    """Full blocks only, equal to the slices an engine would cut, the same tuples each time:
    the prefix caches of every engine a prompt visits store one copy."""
    a = prompt_memo.checked(tuple(range(100)))
    blocks = prompt_memo.prompt_blocks(a, 16)
    assert blocks == tuple(tuple(range(i, i + 16)) for i in range(0, 96, 16))
    assert all(type(b) is tuple for b in blocks)
    again = prompt_memo.prompt_blocks(a, 16)
    assert all(x is y for x, y in zip(blocks, again, strict=True))
    assert prompt_memo.prompt_blocks(a, 128) == ()


def test_the_memo_forgets_everything_past_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt_memo, "LIMIT", 250)
    monkeypatch.setattr(prompt_memo, "_checked", {})
    monkeypatch.setattr(prompt_memo, "_blocks", {})
    monkeypatch.setattr(prompt_memo, "_tokens", 0)
    prompts = [tuple(range(i, i + 100)) for i in range(3)]
    checked = [prompt_memo.checked(p) for p in prompts]
    assert prompt_memo.checked(prompts[2]) is checked[2]  # the third cleared the first two
    assert prompt_memo.checked(prompts[0]) is not checked[0]
