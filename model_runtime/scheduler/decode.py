"""Decode scheduler: continuous batching with preemption by recompute.

Every step each running request gets one slot for the token it is about to compute; requests
join (``add``) and leave (finish, abort) between any two steps. When the pool runs dry the
newest running request is preempted: its blocks are freed and it is handed back to whoever
prefills (it keeps its generated tokens, so recompute resumes exactly where it stopped).
Admission guarantees that any single request fits the pool alone, so the oldest always advances.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import Request, RequestStatus
from pdserve.model_runtime.scheduler.plan import (
    ScheduledChunk,
    SchedulePlan,
    SchedulerConfig,
    StepUpdate,
    allocate_or_preempt,
    apply_chunk,
    make_chunk,
    remove_running,
)


class DecodeScheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.config = config
        self.running: list[Request] = []  # admission order: the newest is last
        self._scheduled: dict[str, Request] = {}

    @property
    def num_running(self) -> int:
        return len(self.running)

    def is_scheduled(self, request_id: str) -> bool:
        return request_id in self._scheduled

    def add(self, req: Request) -> None:
        """Admit a request whose KV for all but its last token is in this scheduler's pool."""
        if req.num_computed_tokens != req.num_tokens - 1:
            raise ValueError(
                f"{req.request_id}: decode needs all but the last token computed "
                f"({req.num_computed_tokens} of {req.num_tokens})"
            )
        req.status = RequestStatus.DECODING
        self.running.append(req)

    def remove(self, request_id: str) -> Request | None:
        return remove_running(self.kv, self.running, request_id)

    def schedule(self, seq_budget: int | None = None) -> SchedulePlan:
        """One decode token per running request, oldest first (and the requests preempted)."""
        limit = self.config.max_num_seqs if seq_budget is None else seq_budget
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        self._scheduled.clear()
        idx = 0
        while idx < len(self.running) and len(chunks) < limit:
            req = self.running[idx]
            if allocate_or_preempt(self.kv, self.running, req, 1, preempted):
                chunks.append(make_chunk(self.kv, req, 1))
                self._scheduled[req.request_id] = req
                idx += 1
        return SchedulePlan(tuple(chunks), tuple(preempted))

    def update(self, plan: SchedulePlan, sampled: Mapping[str, int]) -> StepUpdate:
        out = StepUpdate()
        for chunk in plan.chunks:
            req = self._scheduled.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.DECODING:
                continue
            if apply_chunk(self.kv, req, chunk, sampled):
                self.running.remove(req)
                self.kv.free(req.request_id)
                out.finished.append(req)
        self._scheduled.clear()
        return out
