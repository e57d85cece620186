"""The colocated engine: one process, one block pool, prefill chunks riding along decode steps.

Lifecycle of a request (see ``model_runtime.request`` for the state diagram)::

    add_request -> validate -> ColocatedScheduler (WAITING)
    step(): plan = scheduler.schedule() -> runner.execute(plan) -> scheduler.update(plan)
            -> output trackers (detokenize, stop strings) -> RequestOutput per touched request
    finished or aborted -> blocks freed by the scheduler, per-request state dropped here

The engine is single-threaded: callers serialize ``add_request``/``abort``/``step``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_runtime.config import CacheConfig, ModelConfig
from model_runtime.engine.model_runner import ModelRunner
from model_runtime.engine.output import OutputTracker, RequestOutput
from model_runtime.errors import InvalidRequestError, TokenizerUnavailableError
from model_runtime.kv_cache.manager import KVCacheManager, blocks_needed
from model_runtime.model.loader import load_model, resolve_dtype
from model_runtime.platform import tune_malloc
from model_runtime.presets import resolve_model
from model_runtime.request import FinishReason, Request
from model_runtime.sampling_params import MAX_LOGPROBS_DEFAULT, SamplingParams
from model_runtime.scheduler.colocated import ColocatedScheduler
from model_runtime.scheduler.plan import SchedulerConfig
from model_runtime.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # preset name or Hugging Face directory
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str | None = None  # None/auto: float32 on CPU, bfloat16 on CUDA
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_num_batched_tokens=512))
    max_logprobs: int = MAX_LOGPROBS_DEFAULT

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = config.torch_device()
        if self.device.type == "cpu":
            tune_malloc()
        dtype = resolve_dtype(config.dtype, self.device)
        model_dir: Path = resolve_model(config.model)
        probe = ModelConfig.from_file(model_dir / "config.json")
        self.max_model_len = min(
            config.max_model_len or probe.max_position_embeddings, probe.max_position_embeddings
        )
        t0 = time.perf_counter()
        self.model_config, model = load_model(model_dir, self.device, dtype, self.max_model_len)
        self.tokenizer = TextTokenizer.load(model_dir)
        self.block_size = config.cache.block_size
        num_blocks = config.cache.resolve_num_blocks(self.model_config, torch.finfo(dtype).bits // 8)
        self.kv = KVCacheManager(num_blocks, self.block_size, config.cache.enable_prefix_caching)
        self.scheduler = ColocatedScheduler(self.kv, config.scheduler)
        self.runner = ModelRunner(self.model_config, model, num_blocks, self.block_size)
        self.eos_ids = frozenset(self.model_config.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._trackers: dict[str, OutputTracker] = {}
        log.info(
            "loaded %s (%s, %s) in %.2fs: %d KV blocks of %d tokens",
            model_dir,
            self.model_config.architecture,
            dtype,
            time.perf_counter() - t0,
            num_blocks,
            self.block_size,
        )

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
        vocab = self.model_config.vocab_size
        if not prompt_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        for t in prompt_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError("prompt", f"token id {t!r} is outside the vocabulary [0, {vocab})")
        params.validate(vocab, self.config.max_logprobs)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; use stop_token_ids")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{n} tokens do not fit the context of {self.max_model_len} (one is needed to generate)",
            )
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({n}) + max_tokens ({params.max_tokens}) "
                f"exceeds the context of {self.max_model_len}",
            )
        if blocks_needed(n + params.max_tokens, self.block_size) > self.kv.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the KV cache "
                f"({self.kv.num_blocks * self.block_size} tokens)",
            )

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

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

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

    def check_integrity(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent or blocks leaked while idle."""
        stats = self.kv.check_integrity()
        if not self._requests and stats.used:
            raise AssertionError(f"{stats.used} KV blocks still used with no request in flight")
