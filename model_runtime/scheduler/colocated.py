"""Colocated scheduling: decode and chunked prefill share one pool and one forward pass.

Each step first gives every running decode its token (decode latency is protected), then fills
the rest of the token budget with prefill chunks (Sarathi-style). Requests preempted on either
side are recomputed by the prefill side before new arrivals. This is the baseline that
disaggregation is measured against, and the local-prefill path for short prompts.

With ``SchedulerConfig.colocated = PREFILL_PRIORITY`` a step is instead either whole prompts
only or decodes only, prompts first whenever one can start (vLLM v0's default, the colocated
baseline of DistServe's paper): see ``ColocatedSchedule``.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.request import FinishReason, Request
from pdserve.model_runtime.scheduler.decode import DecodeScheduler
from pdserve.model_runtime.scheduler.plan import ColocatedSchedule, SchedulePlan, SchedulerConfig, StepUpdate
from pdserve.model_runtime.scheduler.prefill import PrefillScheduler


class ColocatedScheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.config = config
        self.prefill = PrefillScheduler(kv, config)
        self.decode = DecodeScheduler(kv, config)
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.prefill.add(req)

    @property
    def has_work(self) -> bool:
        return bool(self.decode.num_running or self.prefill.num_running or self.prefill.num_waiting)

    @property
    def num_waiting(self) -> int:
        return self.prefill.num_waiting

    @property
    def num_running(self) -> int:
        return self.decode.num_running + self.prefill.num_running

    def schedule(self) -> SchedulePlan:
        if self.config.colocated is ColocatedSchedule.PREFILL_PRIORITY:
            return self._schedule_prefill_priority()
        decode = self.decode.schedule(self.config.max_num_seqs)
        for req in decode.preempted:
            self.prefill.add_preempted(req)
        n = len(decode.chunks)
        prefill = self.prefill.schedule(self.config.max_num_batched_tokens - n, self.config.max_num_seqs - n)
        self.num_preemptions += len(decode.preempted) + len(prefill.preempted)
        return SchedulePlan(
            chunks=(*decode.chunks, *prefill.chunks), preempted=(*decode.preempted, *prefill.preempted)
        )

    def schedule_ahead(self) -> SchedulePlan | None:
        """The next step planned while the current one runs (``DecodeScheduler.schedule_ahead``),
        for decode-only stretches: ``None`` while a prompt waits or is part-way (it is planned
        with the tokens the running step yields, after its update)."""
        if self.prefill.num_waiting or self.prefill.num_running:
            return None
        return self.decode.schedule_ahead(self.config.max_num_seqs)

    def _schedule_prefill_priority(self) -> SchedulePlan:
        """Whole waiting prompts if any can start (within the sequence limit and the pool),
        else one decode token for every running request."""
        seqs = self.config.max_num_seqs - self.decode.num_running - self.prefill.num_running
        if seqs > 0 and (self.prefill.num_waiting or self.prefill.num_running):
            plan = self.prefill.schedule(self.config.max_num_batched_tokens, seqs, whole=True)
            if plan.chunks or plan.preempted:
                self.num_preemptions += len(plan.preempted)
                return plan
        plan = self.decode.schedule(self.config.max_num_seqs)
        for req in plan.preempted:
            self.prefill.add_preempted(req)
        self.num_preemptions += len(plan.preempted)
        return plan

    def update(self, plan: SchedulePlan, sampled: Mapping[str, int]) -> StepUpdate:
        decode = tuple(c for c in plan.chunks if self.decode.is_scheduled(c.request_id))
        prefill = tuple(c for c in plan.chunks if not self.decode.is_scheduled(c.request_id))
        out = self.decode.update(SchedulePlan(decode), sampled)
        pre = self.prefill.update(SchedulePlan(prefill), sampled)
        out.finished += pre.finished
        for req in pre.prefilled:
            self.decode.add(req)
        return out

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request early (abort, stop string); frees its blocks wherever it is (a decode
        row in a step in flight: once that step is read, ``DecodeScheduler.remove``)."""
        req = self.decode.remove(request_id) or self.prefill.remove(request_id)
        if req is not None and not req.is_finished:
            req.finish(reason)
        return req
