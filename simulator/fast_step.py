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

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.model_runtime.kv_cache.manager import blocks_needed
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.scheduler.plan import ColocatedSchedule
from pdserve.simulator.virtual import TOKEN


def _continues(req: Request) -> bool:
    """The token this step samples (always ``TOKEN``) does not end ``req``: the rules of
    ``Request.check_token_stop``."""
    p = req.params
    n = len(req.output_token_ids) + 1
    if n >= p.max_tokens:
        return False
    stops = TOKEN in p.stop_token_ids or (not p.ignore_eos and TOKEN in req.eos_token_ids)
    return not (stops and n >= p.min_tokens)


def decode_step(engine: DecodeEngine) -> tuple[list[tuple[int, int]], list[Request]] | None:
    """Run ``engine``'s next step here if it is steady (see the module docstring):
    ``(chunks as (new tokens, start position), the requests that got a token)``; ``None``, and
    nothing changed, when the engine must step itself. The caller has checked that no transfer
    completion waits to be polled."""
    if engine.overlap or engine._launched is not None or engine._pending:
        return None
    sched = engine.scheduler
    config = sched.config
    prefill = sched.prefill
    if prefill.num_waiting or prefill.num_running > 1:
        return None
    rows = sched.decode.running
    n = len(rows)
    if n > config.max_num_seqs:
        return None
    kv = engine.kv
    bs = kv.block_size
    grow = 0
    for req in rows:
        if not _continues(req):
            return None
        if req.num_computed_tokens + 1 > len(kv.block_table(req.request_id)) * bs:
            grow += 1
    prompt: Request | None = None
    take = 0
    if prefill.num_running:
        # a prompt part-way, chunked colocation: the budget the decodes leave goes to its next
        # chunk (``PrefillScheduler.schedule``); its last chunk samples, which the engine does
        prompt = prefill.running[0]
        if config.colocated is not ColocatedSchedule.CHUNKED:
            return None
        budget, seqs = config.max_num_batched_tokens - n, config.max_num_seqs - n
        if budget > 0 and seqs > 0:
            take = min(prompt.num_uncomputed_tokens, budget)
            if config.max_prefill_chunk:
                take = min(take, config.max_prefill_chunk)
            if take >= prompt.num_uncomputed_tokens:
                return None
            have = len(kv.block_table(prompt.request_id))
            grow += max(0, blocks_needed(prompt.num_computed_tokens + take, bs) - have)
    elif not n:
        return None
    if grow > kv.num_free_blocks:
        return None  # someone is preempted: the engine's step decides whom
    rows = list(rows)
    chunks = []
    for req in rows:  # the schedule: a slot for each row's token, oldest row first, then the chunk
        start = req.num_computed_tokens
        if grow and start + 1 > len(kv.block_table(req.request_id)) * bs:
            ok = kv.allocate_slots(req, 1)
            assert ok, "counted the free blocks above"
        chunks.append((1, start))
    if take:
        assert prompt is not None
        ok = kv.allocate_slots(prompt, take)
        assert ok, "counted the free blocks above"
        chunks.append((take, prompt.num_computed_tokens))
    emitted = engine._emitted
    for req in rows:  # the update: each row's token computed, sampled and reported
        req.num_computed_tokens += 1
        if req.num_computed_tokens % bs == 0:  # a block just filled: publish it
            kv.cache_computed_blocks(req)
        req.append_token(TOKEN)
        emitted[req.request_id] = len(req.output_token_ids)
    if take:  # the chunk computed (no token: not the prompt's last)
        assert prompt is not None
        prompt.num_computed_tokens += take
        kv.cache_computed_blocks(prompt)
    return chunks, rows
