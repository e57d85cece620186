"""What the simulator does to a prompt once per prompt object: check its token ids, hash its
blocks and cut them out (pure Python).

A goodput search replays one workload at many rates: the same prompt tuples, point after point
(``pdserve.bench.runner`` draws a trace's prompts once per search). Every engine a request
visits checks its token ids, and the router's prefix keys, the engines' prefix-cache keys and
the work bound hash every full block: for a long-prompt workload most of a point's fixed cost
(eleven million tokens a point at 11,000 a prompt), the same at every point. Both are pure
functions of the tokens, so doing them once changes the cost and nothing else.

The memo holds each prompt it answered for, so an entry's ``id`` cannot be reused by another
object while the entry lives; it is cleared whole past ``LIMIT`` tokens.
"""

from __future__ import annotations

from pdserve.model_runtime.kv_cache.block_pool import BlockKey
from pdserve.model_runtime.validation import CheckedTokens, checked_tokens
from pdserve.router.prefix import block_keys
from pdserve.simulator.virtual import VOCAB

LIMIT = 50_000_000  # prompt tokens remembered (a few hundred MB)

_checked: dict[int, tuple[tuple[int, ...], CheckedTokens]] = {}
_keys: dict[tuple[int, int], tuple[tuple[int, ...], tuple[BlockKey, ...]]] = {}
_blocks: dict[tuple[int, int], tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]] = {}
_tokens = 0


def _room(n: int) -> None:
    global _tokens
    if _tokens + n > LIMIT:
        _checked.clear()
        _keys.clear()
        _blocks.clear()
        _tokens = 0
    _tokens += n


def checked(prompt: tuple[int, ...]) -> CheckedTokens:
    """``prompt`` as ``CheckedTokens`` (ids checked against the simulated vocabulary), the
    same object every time this very ``prompt`` is asked for: the engines then skip the check."""
    entry = _checked.get(id(prompt))
    if entry is not None and entry[0] is prompt:
        return entry[1]
    out = checked_tokens(prompt, VOCAB)
    _room(len(prompt))
    _checked[id(prompt)] = (prompt, out)
    return out


def prompt_keys(prompt: tuple[int, ...], block_size: int) -> tuple[BlockKey, ...]:
    """``pdserve.router.prefix.block_keys(prompt, block_size)``, from the memo when ``prompt``
    (this very object) was asked for before."""
    entry = _keys.get((id(prompt), block_size))
    if entry is not None and entry[0] is prompt:
        return entry[1]
    keys = block_keys(prompt, block_size)
    _room(len(prompt))
    _keys[(id(prompt), block_size)] = (prompt, keys)
    return keys


def prompt_blocks(prompt: tuple[int, ...], block_size: int) -> tuple[tuple[int, ...], ...]:
    """``prompt``'s full blocks as tuples (what the prefix caches store and compare), the same
    tuples every time this very ``prompt`` is asked for."""
    entry = _blocks.get((id(prompt), block_size))
    if entry is not None and entry[0] is prompt:
        return entry[1]
    n = len(prompt) // block_size * block_size
    blocks = tuple(prompt[i : i + block_size] for i in range(0, n, block_size))
    _room(len(prompt))
    _blocks[(id(prompt), block_size)] = (prompt, blocks)
    return blocks
