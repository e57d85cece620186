"""Which queued prompts move when the prefill pool changes (pure Python).

A prompt stays on the prefill worker it was sent to. When the pool grows at a load step, the
workers that were there hold the backlog of the seconds before the new ones joined, and the
new ones take only what arrives after: the backlog's TTFT is what the old workers' queues
make it, however many workers join. When a worker leaves (retired, switching role, or
draining after SIGTERM), its queue waits for it. So whenever the prefill pool changes, the
router takes back prompts that have not started (``Withdraw``: answered by the worker,
atomically between two steps) and routes them again, as new requests are routed.

``withdrawals`` decides which: the router's own record of each worker's prompts that have
no first token yet (a prompt that already started answers no, and stays). The pool's queued
tokens are shared evenly by the workers taking requests (``open_workers``); each gives back
its newest prompts while what it keeps is above that share, and a worker leaving the pool
gives back everything. Nothing moves while every open worker is within ``min_tokens`` of
the share: a move costs a round trip and a new KV reservation, worth it only for a step's
work or more. Nor does a prompt move that has used half its TTFT budget (``worth_moving``):
put ahead of fresh prompts elsewhere it makes them late too, so it is served where it is (a
worker leaving gives back even those: they would hold up its exit).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass


def worth_moving(waited_ms: float, ttft_target_ms: float) -> bool:
    """Whether a prompt that has waited ``waited_ms`` is worth moving: with no TTFT target,
    always; with one, while less than half of it is gone. Moved, a prompt waits again behind
    up to a share of the pool's backlog: one that has spent half its budget is likely late
    anyway, and put ahead of fresh prompts it makes them late as well."""
    return not ttft_target_ms or waited_ms < ttft_target_ms / 2


@dataclass(frozen=True)
class Queued:
    """A prompt sent to a prefill worker whose first token has not come back; ``movable``: see
    ``worth_moving``."""

    request_id: str
    tokens: int
    movable: bool = True


@dataclass(frozen=True)
class Waiting:
    """What the router knows of a prompt sent to a prefill worker, no first token back yet."""

    request_id: str
    dispatched_at: float  # when its current attempt was sent (s, the caller's clock)
    arrival: float  # when the request arrived (s, the same clock)
    tokens: int  # the prompt's
    ttft_target_ms: float  # 0: no target


def queue_of(waiting: Iterable[Waiting], now: float) -> list[Queued]:
    """A prefill worker's queue as ``withdrawals`` reads it: oldest dispatch first, each
    movable while it is ``worth_moving`` at ``now``."""
    ordered = sorted(waiting, key=lambda w: (w.dispatched_at, w.request_id))
    return [
        Queued(w.request_id, w.tokens, worth_moving((now - w.arrival) * 1e3, w.ttft_target_ms))
        for w in ordered
    ]


def withdrawals(
    queues: Mapping[str, Sequence[Queued]], open_workers: Collection[str], min_tokens: int
) -> dict[str, list[str]]:
    """Per prefill worker, the ids to take back, newest first.

    ``queues``: every prefill worker's queued prompts, oldest first (the workers taking
    requests, and those leaving the pool); ``open_workers``: the ones taking requests, which
    the prompts taken back can go to. With no open worker nothing moves (there is nowhere to
    send it)."""
    if min_tokens < 0:
        raise ValueError("min_tokens must be >= 0")
    if not open_workers:
        return {}
    share = sum(_tokens(queue) for queue in queues.values()) / len(open_workers)
    out = {w: [q.request_id for q in reversed(queue)] for w, queue in queues.items() if w not in open_workers}
    if any(_tokens(queues.get(w, ())) - share > min_tokens for w in open_workers):
        out.update((w, _above_share(queues.get(w, ()), share)) for w in open_workers)
    return {w: ids for w, ids in out.items() if ids}


def _tokens(queue: Sequence[Queued]) -> int:
    return sum(q.tokens for q in queue)


def _above_share(queue: Sequence[Queued], share: float) -> list[str]:
    """The newest prompts of ``queue`` whose middle lies past ``share`` tokens: each would
    wait longer here than on a worker holding no more than the share. The walk stops at a
    prompt not worth moving (the ones before it came earlier: not worth it either)."""
    kept = _tokens(queue)
    picked = []
    for q in reversed(queue):
        if kept - q.tokens / 2 <= share or not q.movable:
            break
        picked.append(q.request_id)
        kept -= q.tokens
    return picked
