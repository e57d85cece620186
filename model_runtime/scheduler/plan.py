"""Messages between schedulers and the model runner."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import Request, RequestStatus


class QueuePolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"  # lower ``Request.priority`` first, FCFS among equals


class ColocatedSchedule(enum.Enum):
    """How a colocated engine shares its steps between prefill and decode.

    ``CHUNKED``: every step gives each running decode its token first, then fills the rest of
    the token budget with prefill chunks (Sarathi-Serve, vLLM v1). ``PREFILL_PRIORITY``: a step
    is either a prefill step — waiting prompts, oldest first, whole (never chunked), as many as
    fit the token budget (the first always goes, however long) — or, when no prompt can start,
    a decode step for every running request. Prompts thus interrupt the decode cadence for as
    long as they take: vLLM v0's default scheduler, DistServe's colocated baseline.
    """

    CHUNKED = "chunked"
    PREFILL_PRIORITY = "prefill-priority"


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits.

    ``max_num_batched_tokens`` is the token budget of one forward pass (decode tokens count one
    each; prefill chunks fill what is left). ``max_prefill_chunk`` caps one request's chunk so a
    long prompt cannot monopolise a step (0: no cap beyond the budget). ``colocated`` says how
    a colocated engine interleaves prefill and decode (``ColocatedSchedule``); prefill-only and
    decode-only workers ignore it.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_prefill_chunk: int = 0
    policy: QueuePolicy = QueuePolicy.FCFS
    colocated: ColocatedSchedule = ColocatedSchedule.CHUNKED

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_prefill_chunk < 0:
            raise ValueError("max_prefill_chunk must be >= 0")


# The input of a ``pending`` chunk: a token the host does not know yet.
PENDING_TOKEN = -1


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request to run in this step.

    ``token_ids`` sit at positions ``start_pos ..``; ``block_table`` covers all of them, so the
    runner writes their KV into those blocks. ``sample`` asks for a token from the last position.
    ``pending``: a decode row scheduled ahead (``DecodeScheduler.schedule_ahead``) whose input is
    the token its request sampled in the step launched just before, still on the device; its
    ``token_ids`` hold ``PENDING_TOKEN`` and the runner fills the input in on the device.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    pending: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def single_token(self) -> bool:
        """One new token after cached ones: attention batches it with the decode rows (it reads
        the cache and its own freshly written key, whether or not it samples)."""
        return len(self.token_ids) == 1 and self.start_pos > 0

    @property
    def is_decode(self) -> bool:
        return self.sample and self.single_token


@dataclass(frozen=True)
class SchedulePlan:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...] = ()  # moved back to waiting to make room

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass
class StepUpdate:
    """What changed in a step: requests that finished, and prefills that completed."""

    finished: list[Request] = field(default_factory=list)
    prefilled: list[Request] = field(default_factory=list)


def make_chunk(kv: KVCacheManager, req: Request, num_tokens: int) -> ScheduledChunk:
    start = req.num_computed_tokens
    return ScheduledChunk(
        request_id=req.request_id,
        token_ids=req.token_block(start, start + num_tokens),
        start_pos=start,
        block_table=kv.block_table_view(req.request_id),
        sample=start + num_tokens == req.num_tokens,
    )


def ahead_chunk(kv: KVCacheManager, req: Request) -> ScheduledChunk:
    """The decode row after the one in flight: its input is the token that step samples."""
    return ScheduledChunk(
        request_id=req.request_id,
        token_ids=(PENDING_TOKEN,),
        start_pos=req.num_computed_tokens + 1,
        block_table=kv.block_table_view(req.request_id),
        sample=True,
        pending=True,
    )


def apply_chunk(kv: KVCacheManager, req: Request, chunk: ScheduledChunk, sampled: Mapping[str, int]) -> bool:
    """Advance ``req`` past ``chunk``; append its sampled token. True when the request finished."""
    req.num_computed_tokens += chunk.num_tokens
    kv.cache_computed_blocks(req)
    if not chunk.sample:
        return False
    token = sampled.get(req.request_id)
    if token is None:
        raise KeyError(f"no sampled token for {req.request_id}")
    req.append_token(token)
    return req.check_token_stop()


def preempt(kv: KVCacheManager, req: Request) -> None:
    """Drop the request's KV; it will be recomputed from its prompt and generated tokens."""
    kv.free(req.request_id)
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    req.status = RequestStatus.WAITING


def remove_running(kv: KVCacheManager, running: list[Request], request_id: str) -> Request | None:
    """Take ``request_id`` out of ``running`` and free its blocks; ``None`` if it is not there."""
    for i, r in enumerate(running):
        if r.request_id == request_id:
            del running[i]
            kv.free(request_id)
            return r
    return None


def allocate_or_preempt(
    kv: KVCacheManager, running: list[Request], req: Request, num_tokens: int, preempted: list[Request]
) -> bool:
    """Make room for ``num_tokens`` more of ``req`` (a member of ``running``), preempting the
    newest running requests as needed. False when ``req`` itself had to be preempted."""
    while not kv.allocate_slots(req, num_tokens):
        victim = running.pop()
        preempt(kv, victim)
        preempted.append(victim)
        if victim is req:
            return False
    return True
