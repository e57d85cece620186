"""Decode scheduler: continuous batching with preemption by recompute.

Every step each running request gets one slot for the token it is about to compute; requests
join (``add``) and leave (finish, abort) between any two steps. When the pool runs dry the
newest running request is preempted: its blocks are freed and it is handed back to whoever
prefills (it keeps its generated tokens, so recompute resumes exactly where it stopped).
Admission guarantees that any single request fits the pool alone, so the oldest always advances.

Overlap: ``schedule_ahead`` plans the next decode step while the current one runs, before its
tokens are known, so the device never waits for the host between steps. Each request of the
running step gets a row whose input is the token that step samples (``ahead_chunk``); the
current step's ``update`` then applies stops one step late. A request that stops there (EOS, a
stop id) already has a row in the step in flight: that row's token is dropped, and its blocks,
which that step still writes, are retired (``KVCacheManager.retire``) and return to the pool
with that step's ``update``; so are those of a request removed (aborted) while a step that
holds it runs. At most two decode plans are alive, the one updated next and the one scheduled
ahead of it, and plans are updated in the order they were scheduled. An ahead plan never
preempts: when a row cannot get its slot, the caller finishes the running step first.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.model_runtime.kv_cache.manager import KVCacheManager, blocks_needed
from pdserve.model_runtime.request import Request, RequestStatus
from pdserve.model_runtime.scheduler.plan import (
    ScheduledChunk,
    SchedulePlan,
    SchedulerConfig,
    StepUpdate,
    ahead_chunk,
    allocate_or_preempt,
    apply_chunk,
    make_chunk,
)


class DecodeScheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.config = config
        self.running: list[Request] = []  # admission order: the newest is last
        self._scheduled: dict[str, Request] = {}  # the plan updated next
        self._ahead: dict[str, Request] | None = None  # the plan scheduled ahead of it
        self._retired: list[int] = []  # blocks the plan updated next still writes
        self._retired_ahead: list[int] = []  # blocks the plan ahead still writes

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
        """Take a running request out (abort). Its blocks return to the pool now, or with the
        update of the last scheduled plan that holds it (that step may still write them)."""
        for i, r in enumerate(self.running):
            if r.request_id == request_id:
                del self.running[i]
                self._release_blocks(r)
                return r
        return None

    def _release_blocks(self, req: Request) -> None:
        """``req`` left the running set: free its blocks, or retire them until the update of the
        last scheduled plan that holds it (in the plan updated next, that is the end of its
        update)."""
        rid = req.request_id
        if self._ahead is not None and self._ahead.get(rid) is req:
            held = self._retired_ahead
        elif self._scheduled.get(rid) is req:
            held = self._retired
        else:
            self.kv.free(rid)
            return
        handle = self.kv.retire(rid)
        if handle is not None:
            held.append(handle)

    def will_continue(self, req: Request) -> bool:
        """The token the running step samples for ``req`` may not be its last (only a stop
        token can end it then): worth a row in the step ahead."""
        return req.num_output_tokens + 1 < req.params.max_tokens

    def schedule(self, seq_budget: int | None = None) -> SchedulePlan:
        """One decode token per running request, oldest first (and the requests preempted)."""
        if self._ahead is not None or self._retired:
            raise RuntimeError("a decode plan is still in flight: update it before scheduling")
        self._scheduled = {}  # (a plan scheduled and never run is dropped; nothing of it is held)
        limit = self.config.max_num_seqs if seq_budget is None else seq_budget
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        idx = 0
        while idx < len(self.running) and len(chunks) < limit:
            req = self.running[idx]
            if allocate_or_preempt(self.kv, self.running, req, 1, preempted):
                chunks.append(make_chunk(self.kv, req, 1))
                self._scheduled[req.request_id] = req
                idx += 1
        return SchedulePlan(tuple(chunks), tuple(preempted))

    def schedule_ahead(self, seq_budget: int | None = None) -> SchedulePlan | None:
        """The next decode step, planned while the scheduled one runs (see the module
        docstring); ``None`` when it cannot be planned without preempting (or nothing is to
        run), and the caller updates the running step first. Changes nothing on ``None``."""
        if self._ahead is not None:
            raise RuntimeError("a plan is already scheduled ahead")
        limit = self.config.max_num_seqs if seq_budget is None else seq_budget
        rows: list[tuple[Request, bool]] = []  # (request, its input is pending)
        for req in self.running:
            if len(rows) == limit:
                break
            pending = self._scheduled.get(req.request_id) is req
            if pending and not self.will_continue(req):
                continue
            rows.append((req, pending))
        bs = self.kv.block_size
        need = sum(
            max(0, blocks_needed(r.num_computed_tokens + 1 + p, bs) - len(self.kv.block_table(r.request_id)))
            for r, p in rows
        )
        if not rows or need > self.kv.num_free_blocks:
            return None
        chunks: list[ScheduledChunk] = []
        for req, pending in rows:
            ok = self.kv.allocate_slots(req, 1 + pending)
            assert ok, "counted free blocks above"
            chunks.append(ahead_chunk(self.kv, req) if pending else make_chunk(self.kv, req, 1))
        self._ahead = {req.request_id: req for req, _ in rows}
        return SchedulePlan(tuple(chunks))

    def update(self, plan: SchedulePlan, sampled: Mapping[str, int]) -> StepUpdate:
        """Apply the oldest scheduled plan's tokens (a request removed or already finished
        meanwhile is skipped: its row's token is dropped)."""
        out = StepUpdate()
        for chunk in plan.chunks:
            req = self._scheduled.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.DECODING:
                continue
            if apply_chunk(self.kv, req, chunk, sampled):
                self.running.remove(req)
                out.finished.append(req)
                self._release_blocks(req)
        for handle in self._retired:
            self.kv.release(handle)
        self._scheduled = self._ahead or {}
        self._retired = self._retired_ahead
        self._ahead, self._retired_ahead = None, []
        return out
