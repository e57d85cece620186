"""Prefill scheduler: a token budget per step, chunked prefill, FCFS or priority order.

Requests already part-way through their prompt go first (they hold blocks); then waiting ones,
in queue order, each taking its prefix-cache hit and as many tokens as the budget allows. The
queue is strict: when the head cannot get blocks, nobody behind it jumps ahead (no starvation).
If a part-way request cannot grow, the newest part-way request is preempted (recompute).
With ``whole=True`` prompts are never chunked: a prompt goes only if all of it fits what is
left of the budget, except the step's first, which goes whatever its length (prefill-priority
colocation, ``ColocatedSchedule.PREFILL_PRIORITY``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Mapping

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import Request, RequestStatus
from pdserve.model_runtime.scheduler.plan import (
    QueuePolicy,
    ScheduledChunk,
    SchedulePlan,
    SchedulerConfig,
    StepUpdate,
    allocate_or_preempt,
    apply_chunk,
    make_chunk,
    remove_running,
)


class PrefillScheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.config = config
        self._heap: list[tuple[int, int, Request]] = []
        self._preempted: deque[Request] = deque()
        self._seq = itertools.count()
        self.running: list[Request] = []  # part-way through their prompt, in start order
        self._scheduled: dict[str, Request] = {}

    # -- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        prio = req.priority if self.config.policy is QueuePolicy.PRIORITY else 0
        heapq.heappush(self._heap, (prio, next(self._seq), req))

    def add_preempted(self, req: Request) -> None:
        """Preempted requests are recomputed before any new arrival."""
        self._preempted.append(req)

    @property
    def num_waiting(self) -> int:
        return len(self._heap) + len(self._preempted)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _peek(self) -> Request | None:
        if self._preempted:
            return self._preempted[0]
        return self._heap[0][2] if self._heap else None

    def _pop(self) -> Request:
        return self._preempted.popleft() if self._preempted else heapq.heappop(self._heap)[2]

    def remove(self, request_id: str) -> Request | None:
        """Take a request out wherever it is (waiting or part-way); frees its blocks."""
        found = remove_running(self.kv, self.running, request_id)
        if found is not None:
            return found
        for r in self._preempted:
            if r.request_id == request_id:
                self._preempted.remove(r)
                return r
        return self.withdraw(request_id)

    def withdraw(self, request_id: str) -> Request | None:
        """Take out a request that has not started: waiting, holding no blocks, nothing computed
        (a preempted one has computed work behind it, so it stays). ``None`` if it is not one."""
        for i, (_, _, r) in enumerate(self._heap):
            if r.request_id == request_id:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return r
        return None

    # -- planning ----------------------------------------------------------------------------
    def _chunk_len(self, remaining: int, budget: int, whole: bool = False, first: bool = False) -> int:
        """Tokens to run now of ``remaining``; 0: this request does not fit the step."""
        if whole:
            return remaining if first or remaining <= budget else 0
        n = min(remaining, budget)
        if self.config.max_prefill_chunk:
            n = min(n, self.config.max_prefill_chunk)
        return n

    def schedule(
        self, token_budget: int | None = None, seq_budget: int | None = None, whole: bool = False
    ) -> SchedulePlan:
        """Plan this step's prefill chunks (and the requests preempted to make room).
        ``whole``: whole prompts only (see the module docstring)."""
        budget = self.config.max_num_batched_tokens if token_budget is None else token_budget
        seqs = self.config.max_num_seqs if seq_budget is None else seq_budget
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        self._scheduled.clear()

        idx = 0
        while idx < len(self.running) and budget > 0 and seqs > 0:
            req = self.running[idx]
            n = self._chunk_len(req.num_uncomputed_tokens, budget, whole, not chunks)
            if n == 0:
                break
            if allocate_or_preempt(self.kv, self.running, req, n, preempted):
                chunks.append(make_chunk(self.kv, req, n))
                self._scheduled[req.request_id] = req
                budget -= n
                seqs -= 1
                idx += 1
        for victim in preempted:
            self.add_preempted(victim)
        if preempted:
            return SchedulePlan(tuple(chunks), tuple(preempted))

        while budget > 0 and seqs > 0:
            head = self._peek()
            if head is None:
                break
            req = head
            hits, hit_tokens = self.kv.get_computed_blocks(req)
            req.num_computed_tokens = 0
            n = self._chunk_len(req.num_tokens - hit_tokens, budget, whole, not chunks)
            if n == 0 or not self.kv.allocate_slots(req, n, hits):
                break
            self._pop()
            req.num_computed_tokens = hit_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = hit_tokens
            req.status = RequestStatus.PREFILLING
            self.running.append(req)
            chunks.append(make_chunk(self.kv, req, n))
            self._scheduled[req.request_id] = req
            budget -= n
            seqs -= 1
        return SchedulePlan(tuple(chunks), tuple(preempted))

    def update(self, plan: SchedulePlan, sampled: Mapping[str, int]) -> StepUpdate:
        """Apply a step's results. Completed prompts leave this scheduler as ``prefilled`` (with
        their first token) or ``finished`` (that token already ended them; blocks freed)."""
        out = StepUpdate()
        for chunk in plan.chunks:
            req = self._scheduled.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.PREFILLING:
                continue  # removed (aborted) while the step ran
            done = apply_chunk(self.kv, req, chunk, sampled)
            if not chunk.sample:
                continue
            self.running.remove(req)
            if done:
                self.kv.free(req.request_id)
                out.finished.append(req)
            else:
                req.status = RequestStatus.PREFILLED
                out.prefilled.append(req)
        self._scheduled.clear()
        return out
