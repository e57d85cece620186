"""Messages between the router and the workers: frozen, typed, plain data (pure Python).

Everything here is built from ints, floats, strings and tuples, so it can cross any process
boundary (Ray today) without pickling application objects and could be framed as msgpack.

A request's path through these messages (disaggregated)::

    router                          decode worker                     prefill worker
    WorkItem + transfer id  ---->   queue a reservation; await it -> KVTarget
    WorkItem + KVTarget     -------------------------------------->  prefill, push KV
                            <--------------------------------------  TokenDelta(first token, prefilled)
    start(first token)      ---->   transfer done + token: decode
                            <----   TokenDelta per step (batched: one OutputBatch per step)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.model_runtime.kv_cache.block_pool import BlockKey
from pdserve.model_runtime.sampling.logprob import Logprob
from pdserve.model_runtime.sampling_params import SamplingParams

__all__ = [
    "KVTarget",
    "KvEvents",
    "Logprob",
    "OutputBatch",
    "PlacedWork",
    "TokenDelta",
    "TransferCounters",
    "WorkItem",
    "WorkerHealth",
    "WorkerInfo",
    "WorkerLoad",
    "WorkerRole",
]


class WorkerRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # a decode worker that prefills every request itself


class WorkerHealth(enum.Enum):
    """``STARTING -> HEALTHY <-> DRAINING``; ``UNHEALTHY`` is terminal (set by the router when
    the process stops answering or dies)."""

    STARTING = "starting"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"


@dataclass(frozen=True)
class WorkItem:
    """One sequence to generate; the router has validated and tokenized it.

    ``output_token_ids``: tokens already generated (and sent to the client) for a request the
    router moved off a lost worker; the worker recomputes prompt + these and goes on from
    there, so ``params.max_tokens`` still counts them and a seeded draw is the one it would
    have been (it depends on the token's position, not on where it was drawn).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVTarget:
    """Where a prefill worker pushes a request's KV: blocks reserved on a decode worker."""

    transfer_id: str
    address: str  # the decode worker's transport, "host:port"
    offers: tuple[str, ...]  # backends that transport accepts
    blocks: tuple[int, ...]  # destination block ids, one per prompt block, in order
    # A tensor-parallel decode worker's ranks' transports, rank 0's first (its degree is their
    # count); empty for a one-rank worker, reached at ``address``.
    ranks: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """What one step added to one request.

    ``prefilled`` marks a prefill worker's message with the first token of a request that goes
    on decoding elsewhere; ``kv_lost`` its later word that the prompt's KV will not arrive
    there (the push failed), so the decode worker must recompute it. ``finished`` is the
    request's last message from that worker; ``finish_reason`` is a ``FinishReason`` value, or
    "error" with ``error`` set (the worker could not serve it).
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    prefilled: bool = False
    error: str | None = None
    kv_lost: bool = False


@dataclass(frozen=True)
class WorkerInfo:
    """What the router learns from a worker once it is ready."""

    worker_id: str
    role: WorkerRole
    address: str  # its KV transport address (decode) or "" (prefill, colocated)
    model_dir: str
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int
    dtype: str
    kv_blocks: int
    max_logprobs: int
    has_tokenizer: bool
    pid: int
    node: str
    step_tokens: int = 0  # the scheduler's token budget per step (bounds local prefill chunks)
    tp: int = 1  # tensor-parallel degree: GPUs the worker spans (part of its identity)
    kv_ranks: int = 1  # ranks that hold KV shards and move them (1 for an emulated worker)


@dataclass(frozen=True)
class TransferCounters:
    """A worker's KV transfers since it started: sent (prefill) or received (decode)."""

    seconds: float = 0.0
    count: int = 0
    failures: tuple[tuple[str, int], ...] = ()  # (cause, count)
    by_backend: tuple[tuple[str, int], ...] = ()  # (backend, bytes) of the completed transfers

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.by_backend)


@dataclass(frozen=True)
class PlacedWork:
    """Work on one worker that other router replicas placed (what a replica's own ledger
    cannot see), summed over their requests; zero with one router."""

    prefills: int = 0  # prompts queued or prefilling (first token not out yet)
    prefill_tokens: int = 0  # their prompt tokens (and output tokens carried) to compute
    decodes: int = 0  # requests reserved on / running in the decode batch
    decode_context: int = 0  # their summed expected mean context (prompt + max_tokens // 2)
    decode_remaining: int = 0  # their summed max_tokens still to generate


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load and KV usage, sent with every output batch (the router's view of it)."""

    worker_id: str
    role: WorkerRole
    address: str
    running: int
    waiting: int
    kv_total: int
    kv_free: int
    kv_cached: int
    health: WorkerHealth = WorkerHealth.HEALTHY
    transfers: TransferCounters | None = None
    # seconds of wall time its steps that computed something took since it started (polls for
    # transfers alone excluded): the pool planner reads the pool's speed off its differences
    busy_s: float = 0.0
    tp: int = 1  # the worker's degree (``WorkerInfo.tp``; the router fills it in for its status)
    # the work the other router replicas placed here (``pdserve.worker.owners``): each replica
    # adds it to its own ledger's view of this worker
    others: PlacedWork = PlacedWork()

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_free / self.kv_total if self.kv_total else 0.0


@dataclass(frozen=True)
class KvEvents:
    """What changed in a worker's prefix cache (the chained keys of its cached full blocks):
    ``ops`` in the order they happened, ``True`` a key stored, ``False`` one removed. With
    ``snapshot`` set, the receiver first replaces its view of the worker with those keys (a
    new connection's first batch, or a log that overflowed): a snapshot reflects every op
    taken before it, and ops it already reflects may come again after it (each op sets a
    key's state, so applying one again changes nothing)."""

    ops: tuple[tuple[bool, BlockKey], ...] = ()
    snapshot: tuple[BlockKey, ...] | None = None


@dataclass(frozen=True)
class OutputBatch:
    """All deltas since the previous collect, in step order, plus the worker's current load
    and what changed in its prefix cache meanwhile (``None``: nothing)."""

    deltas: tuple[TokenDelta, ...]
    load: WorkerLoad
    kv: KvEvents | None = None
