"""A simulated step applied straight to the engine's state, when the step is steady.

Most of a simulated cluster's steps are steady: every running request gets one token and, on a
chunked colocated worker, at most one prompt already part-way gets its next chunk (not its
last); nothing else happens (no prompt waits, no transfer landed, no reservation waits, no row
ends or needs room it cannot get). Long prompts make these the bulk of a run: at the rate a
long-prompt workload is served each worker holds a few requests at a time and steps hundreds of
times per request, and a prompt takes tens of chunks. Through the engine such a step costs the
whole machinery (a plan, chunk objects with their token tuples, a runner call, an update, a
token delta per row, the router's delta handling); here it costs a few integer updates per row.

``decode_step`` is exact: it makes the state changes the engine's ``step()`` makes on such a
step, in the same order (each row's new block, if it crosses into one, in row order, then the
chunk's blocks; then each row's token and the blocks it completes published, in row order,
then the chunk's), and returns the same chunks for the step-time model; the caller reports each
row's token at the step's end as the router takes a one-token delta (``Cluster.on_tokens``).
When any condition does not hold it changes nothing and returns ``None``: the engine steps as
usual. The tests compare whole runs with and without it.
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.model_runtime.kv_cache.manager import KVCacheManager, blocks_needed
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.scheduler.plan import ColocatedSchedule
from pdserve.model_runtime.scheduler.prefill import PrefillScheduler
from pdserve.prefill_worker.engine import PrefillEngine
from pdserve.simulator.virtual import TOKEN


class Steady(NamedTuple):
    """A step run here: its chunks for the step-time model (new tokens, start position, in the
    plan's order), the requests that got a token, and those of them it ended."""

    chunks: list[tuple[int, int]]
    rows: list[Request]
    finished: list[Request]


def _chunk(
    prefill: PrefillScheduler, kv: KVCacheManager, budget: int, seqs: int, cap: int
) -> tuple[Request | None, int, int] | None:
    """What ``PrefillScheduler.schedule(budget, seqs)`` does this step, if it is steady:
    ``(prompt, tokens, blocks to allocate)`` — the oldest prompt part-way takes a chunk that is
    not its last, and nothing behind it is looked at (the budget or the sequences are spent, or
    nothing else waits or runs); ``(None, 0, 0)`` when nothing is scheduled and nothing looked
    at; ``None`` otherwise (a prompt starts or ends: the engine steps)."""
    if budget <= 0 or seqs <= 0:
        return None, 0, 0
    if not prefill.running:
        return None if prefill.num_waiting else (None, 0, 0)
    prompt = prefill.running[0]
    left = prompt.num_uncomputed_tokens
    take = min(left, budget, cap) if cap else min(left, budget)
    if take >= left:
        return None  # its last chunk: it samples the first token
    others = len(prefill.running) > 1 or prefill.num_waiting
    if others and budget - take > 0 and seqs - 1 > 0:
        return None  # what is left of the step goes to the next prompt
    have = len(kv.block_table(prompt.request_id))
    return prompt, take, max(0, blocks_needed(prompt.num_computed_tokens + take, kv.block_size) - have)


def _compute(kv: KVCacheManager, prompt: Request | None, take: int) -> None:
    """A chunk of ``prompt`` computed (no token: not its last), its full blocks published."""
    if prompt is not None and take:
        prompt.num_computed_tokens += take
        kv.cache_computed_blocks(prompt)


def prefill_step(engine: PrefillEngine) -> Steady | None:
    """A prefill worker's next step here if it is steady: a chunk of its oldest prompt, not the
    last (no request gets a token). The caller has checked that no transfer completion waits
    to be reaped."""
    if engine._pending_errors:
        return None
    sched = engine.scheduler
    config = sched.config
    kv = engine.kv
    got = _chunk(sched, kv, config.max_num_batched_tokens, config.max_num_seqs, config.max_prefill_chunk)
    if got is None or got[0] is None or got[2] > kv.num_free_blocks:
        return None
    prompt, take, _ = got
    assert prompt is not None  # (checked above: mypy does not narrow a tuple's item)
    start = prompt.num_computed_tokens
    ok = kv.allocate_slots(prompt, take)
    assert ok, "counted the free blocks above"
    _compute(kv, prompt, take)
    return Steady([(take, start)], [], [])


def decode_step(engine: DecodeEngine) -> Steady | None:
    """Run ``engine``'s next step here if it is steady (see the module docstring); ``None``
    when the engine must step itself. Either way it first does what ``step()`` does first (take
    in the transfers that landed, grant waiting reservations): idempotent, so ``step()`` doing
    it again finds nothing more to do."""
    if engine.overlap or engine._launched is not None:
        return None
    engine._poll_transfers()
    if engine._pending:
        engine._serve_pending()
    sched = engine.scheduler
    config = sched.config
    prefill = sched.prefill
    decode = sched.decode
    rows = decode.running
    n = len(rows)
    if n > config.max_num_seqs:
        return None
    kv = engine.kv
    if config.colocated is ColocatedSchedule.PREFILL_PRIORITY:
        # a step of whole prompts whenever one may start (``ColocatedScheduler``)
        if config.max_num_seqs - n - prefill.num_running > 0 and (prefill.num_waiting or prefill.num_running):
            return None
        got: tuple[Request | None, int, int] | None = (None, 0, 0)
    else:  # chunked: the budget the decodes leave goes to prompts
        got = _chunk(
            prefill, kv, config.max_num_batched_tokens - n, config.max_num_seqs - n, config.max_prefill_chunk
        )
    if got is None or not (n or got[1]):
        return None
    prompt, take, grow = got
    bs = kv.block_size
    for req in rows:
        if req.num_computed_tokens + 1 > len(kv.block_table(req.request_id)) * bs:
            grow += 1
    if grow > kv.num_free_blocks:
        return None  # someone is preempted: the engine's step decides whom
    rows = list(rows)
    chunks = []
    # the schedule (``DecodeScheduler.schedule``, then ``PrefillScheduler.schedule``): a slot
    # for each row's token, oldest row first, then the chunk
    for req in rows:
        start = req.num_computed_tokens
        if grow and start + 1 > len(kv.block_table(req.request_id)) * bs:
            ok = kv.allocate_slots(req, 1)
            assert ok, "counted the free blocks above"
        chunks.append((1, start))
    if prompt is not None:
        ok = kv.allocate_slots(prompt, take)
        assert ok, "counted the free blocks above"
        chunks.append((take, prompt.num_computed_tokens))
    # the update (``DecodeScheduler.update``, then ``PrefillScheduler.update``): each row's
    # token computed and sampled, a row it ends leaving the batch, its blocks returned once
    # every row is done (``retire``, then ``release``); then the chunk
    emitted = engine._emitted
    finished = []
    handles = []
    for req in rows:
        req.num_computed_tokens += 1
        if req.num_computed_tokens % bs == 0:  # a block just filled: publish it
            kv.cache_computed_blocks(req)
        req.append_token(TOKEN)
        if req.check_token_stop():
            decode.running.remove(req)
            finished.append(req)
            handle = kv.retire(req.request_id)
            if handle is not None:
                handles.append(handle)
        else:
            emitted[req.request_id] = len(req.output_token_ids)
    for handle in handles:
        kv.release(handle)
    _compute(kv, prompt, take)
    for req in finished:  # what ``DecodeEngine._finish`` does with an ended request
        engine._requests.pop(req.request_id, None)
        engine._emitted.pop(req.request_id, None)
        engine.rt.runner.release(req.request_id)
    if engine._pending and finished:
        engine._serve_pending()
    return Steady(chunks, rows, finished)
