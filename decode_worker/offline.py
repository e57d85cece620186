"""The colocated engine driven in process: ``pdserve generate``, ``pdserve profile``, benchmarks
and tests.

There is one colocated engine, the decode engine in its colocated role
(``DecodeEngine(..., WorkerRole.COLOCATED)``), which a ``--colocated`` deployment serves with.
``OfflineDriver`` builds it and its runtime from an ``EngineConfig`` and drives it the way the
router drives a worker, without the process around it: it tokenizes and adds requests
(``add_local``), steps the engine, turns each request's new tokens into text (detokenization
and stop strings, ``OutputTracker``; a stop string aborts the request as the router's stream
does) and runs a batch to its end (``generate``). It schedules nothing itself.

Single-threaded: one caller serializes every method.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pdserve.decode_worker.engine import DecodeEngine
from pdserve.model_runtime.config import EngineConfig, ModelConfig
from pdserve.model_runtime.engine.output import OutputTracker, RequestOutput
from pdserve.model_runtime.engine.runtime import Runtime, StepRunner, build_runtime
from pdserve.model_runtime.errors import InvalidRequestError, TokenizerUnavailableError
from pdserve.model_runtime.kv_cache.manager import KVCacheManager, check_idle
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.colocated import ColocatedScheduler
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.worker.messages import WorkerRole, WorkItem

__all__ = ["EngineConfig", "OfflineDriver"]


class OfflineDriver:
    def __init__(self, config: EngineConfig | None = None, overlap: bool = False) -> None:
        """``overlap``: keep a decode step in flight (``DecodeEngine``); off, every ``step``
        returns the tokens of the step it ran (what ``profile`` times)."""
        self.config = config = config or EngineConfig()
        self.runtime: Runtime = build_runtime(config)
        self.engine = DecodeEngine(
            self.runtime, None, config.scheduler, "offline", WorkerRole.COLOCATED, overlap=overlap
        )
        self.limits = self.runtime.limits()
        self._trackers: dict[str, OutputTracker] = {}

    # -- what the runtime holds --------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def model_config(self) -> ModelConfig:
        return self.runtime.model_config

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return self.runtime.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.runtime.max_model_len

    @property
    def kv(self) -> KVCacheManager:
        return self.runtime.kv

    @property
    def runner(self) -> StepRunner:
        return self.runtime.runner

    @property
    def scheduler(self) -> ColocatedScheduler:
        return self.engine.scheduler

    # -- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if self.tokenizer is None:
                raise TokenizerUnavailableError()
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> Request:
        params = params or SamplingParams()
        if request_id in self._trackers:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        prompt_ids = tuple(self.tokenize(prompt))
        self.engine.add_local(WorkItem(request_id, prompt_ids, params, priority))  # validates it
        req = self.engine.held(request_id)
        assert req is not None
        self._trackers[request_id] = OutputTracker(req, self.tokenizer)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already done."""
        if self._trackers.pop(request_id, None) is None:
            return False
        self.engine.abort(request_id)
        return True

    @property
    def request_ids(self) -> list[str]:
        """The requests not finished yet, oldest first."""
        return list(self._trackers)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._trackers)

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; an output for every request it added tokens to."""
        outputs: list[RequestOutput] = []
        for delta in self.engine.step():
            rid = delta.request_id
            tracker = self._trackers.get(rid)
            if tracker is None:
                continue
            if delta.error is not None:  # the engine gave the request up (a refused constraint)
                del self._trackers[rid]
                raise InvalidRequestError("request", f"{rid}: {delta.error}")
            out, hit_stop = tracker.step(delta.logprobs[-1] if delta.logprobs else None)
            req = tracker.req
            if hit_stop and not req.is_finished:
                self.engine.abort(rid)
                tracker.finish_on_stop_string()
                out.finished, out.finish_reason, out.stop_reason = True, req.finish_reason, req.stop_reason
            outputs.append(out)
            if out.finished:
                del self._trackers[rid]
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
            if not self.engine.has_work:  # waiting on a grammar's compile: no spin
                time.sleep(self.engine.io_wait_s())
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def request_state(self) -> dict[str, int]:
        """Sizes of the per-request maps of the engine, its KV manager and this driver (0 when idle)."""
        return {**self.engine.request_state(), "trackers": len(self._trackers)}

    def check_integrity(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent, or blocks or per-request state
        leaked while idle."""
        idle = self.engine.idle and not self._trackers
        check_idle(self.kv, idle, self.request_state() if idle else {})
