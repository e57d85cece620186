"""The colocated engine: one process, one block pool, prefill chunks riding along decode steps.

Lifecycle of a request (see ``pdserve.model_runtime.request`` for the state diagram)::

    add_request -> validate -> ColocatedScheduler (WAITING)
    step(): plan = scheduler.schedule() -> runner.execute(plan) -> scheduler.update(plan)
            -> output trackers (detokenize, stop strings) -> RequestOutput per touched request
    finished or aborted -> blocks freed by the scheduler, per-request state dropped here

The engine is single-threaded: callers serialize ``add_request``/``abort``/``step``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdserve.model_runtime.config import EngineConfig
from pdserve.model_runtime.engine.output import OutputTracker, RequestOutput
from pdserve.model_runtime.engine.runtime import build_runtime
from pdserve.model_runtime.errors import InvalidRequestError, TokenizerUnavailableError
from pdserve.model_runtime.kv_cache.manager import check_idle
from pdserve.model_runtime.request import FinishReason, Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.colocated import ColocatedScheduler
from pdserve.model_runtime.validation import validate_request

__all__ = ["EngineConfig", "LLMEngine"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        rt = self.runtime = build_runtime(config)
        self.device = rt.device
        self.max_model_len = rt.max_model_len
        self.model_config = rt.model_config
        self.tokenizer = rt.tokenizer
        self.block_size = rt.block_size
        self.kv = rt.kv
        self.runner = rt.runner
        self.limits = rt.limits()
        self.scheduler = ColocatedScheduler(self.kv, config.scheduler)
        self.eos_ids = rt.eos_ids
        self._requests: dict[str, Request] = {}
        self._trackers: dict[str, OutputTracker] = {}

    # -- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if self.tokenizer is None:
                raise TokenizerUnavailableError()
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for anything this engine cannot serve."""
        validate_request(prompt_ids, params, self.limits)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> Request:
        params = params or SamplingParams()
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        req = Request(request_id, tuple(prompt_ids), params, self.eos_ids, priority=priority)
        self._requests[request_id] = req
        self._trackers[request_id] = OutputTracker(req, self.tokenizer)
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        if request_id not in self._requests:
            return False
        self.scheduler.finish(request_id, FinishReason.ABORT)
        self._drop(request_id)
        return True

    def _drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._trackers.pop(request_id, None)
        self.runner.release(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        result = self.runner.execute(plan.chunks, self._requests)
        update = self.scheduler.update(plan, result.sampled)
        outputs: list[RequestOutput] = []
        for rid in result.sampled:
            req = self._requests.get(rid)
            if req is None:
                continue
            out, hit_stop = self._trackers[rid].step(result.logprobs.get(rid))
            if hit_stop and not req.is_finished:
                self.scheduler.finish(rid, FinishReason.STOP_STRING)
                self._trackers[rid].finish_on_stop_string()
                out.finished, out.finish_reason, out.stop_reason = True, req.finish_reason, req.stop_reason
            outputs.append(out)
            if out.finished:
                self._drop(rid)
        for req in update.finished:
            self._drop(req.request_id)
        return outputs

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Offline batch generation: run until every prompt finished; outputs in prompt order."""
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished:
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def request_state(self) -> dict[str, int]:
        """Sizes of the per-request maps of the engine and its KV manager (0 when idle)."""
        scheduled = self.scheduler.num_waiting + self.scheduler.num_running
        return {
            **self.kv.request_state(),
            "requests": len(self._requests),
            "trackers": len(self._trackers),
            "runner": self.runner.kept_requests(),
            "scheduled": scheduled,
        }

    def check_integrity(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent, or blocks or per-request state
        leaked while idle."""
        idle = not self._requests
        check_idle(self.kv, idle, self.request_state() if idle else {})
