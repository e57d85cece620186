"""Everything one worker process needs to run steps: model, KV pool, runner, tokenizer.

``build_runtime`` is shared by both worker roles (the colocated one too) and the offline
driver, so every role loads a model, sizes its pool and validates requests the same way.
``compute="zero"`` swaps the model for ``ZeroRunner`` (deterministic tokens, no math) to
measure the serving path alone;
``compute="emulated:<profile>"`` for ``EmulatedRunner``, which also takes the time a real GPU
would (``pdserve.steptime``), with the pool sized as that GPU's KV memory and a one-layer
stand-in cache (transfers still run for real; their GPU-link time is added by the decode side).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.model_runtime import attention_tuning
from pdserve.model_runtime.backend import (
    Backend,
    choose_backend,
    decode_scratch_bytes,
    kv_blocks_for_free_memory,
    step_reserve_bytes,
    use_overlap,
)
from pdserve.model_runtime.checkpoint import Checkpoint
from pdserve.model_runtime.config import EngineConfig, ModelConfig
from pdserve.model_runtime.engine.model_runner import GraphSettings, ModelRunner
from pdserve.model_runtime.engine.runner import DoneStep, StepHandle, StepResult
from pdserve.model_runtime.kernels.launch import triton_available
from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.kv_cache.tensors import kv_cache_shape, new_kv_cache
from pdserve.model_runtime.model.loader import TPRank, load_model, resolve_dtype
from pdserve.model_runtime.parallel import follower
from pdserve.model_runtime.parallel.launch import (
    RankEntry,
    RankSetup,
    agree_on_blocks,
    check_tp,
    join_follower,
    rank_device,
    start_leader,
)
from pdserve.model_runtime.parallel.ranks import RankArgs
from pdserve.model_runtime.parallel.sharding import rank_config
from pdserve.model_runtime.platform import tune_malloc, use_threads
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.scheduler.plan import ScheduledChunk
from pdserve.model_runtime.structured.compiler import Grammars
from pdserve.model_runtime.tokenizer import TextTokenizer
from pdserve.model_runtime.validation import RequestLimits
from pdserve.steptime.model import StepTimeModel

log = logging.getLogger(__name__)

# (shape, dtype, device) -> cache tensor; lets a worker place its cache in shared memory.
CacheAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def torch_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


class StepRunner(Protocol):
    kv_cache: torch.Tensor

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult: ...

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> StepHandle: ...

    def release(self, request_id: str) -> None: ...

    def kept_requests(self) -> int: ...


class ZeroRunner:
    """A runner that does no math: each sampled token is a fixed function of the position and
    the previous token, never EOS, so outputs are deterministic and run to ``max_tokens``.
    It owns a real KV cache so transfers still move real bytes."""

    def __init__(self, config: ModelConfig, kv_cache: torch.Tensor) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self._eos = frozenset(config.eos_token_ids)
        self.num_layers = kv_cache.shape[0]
        self._previous: dict[str, int] = {}  # the last step's tokens: ``pending`` chunks' inputs

    def token_for(self, previous: int, position: int) -> int:
        t = (previous * 31 + position * 7 + 11) % self.config.vocab_size
        while t in self._eos:
            t = (t + 1) % self.config.vocab_size
        return t

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        if on_layer is not None:
            for i in range(self.num_layers):
                on_layer(i)
        return self._sample(chunks)

    def _sample(self, chunks: Sequence[ScheduledChunk]) -> StepResult:
        previous, self._previous = self._previous, {}
        sampled = {}
        for c in chunks:
            if c.sample:
                last = previous[c.request_id] if c.pending else c.token_ids[-1]
                sampled[c.request_id] = self.token_for(last, c.start_pos + c.num_tokens)
        self._previous = sampled
        return StepResult(sampled, {})

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> StepHandle:
        return DoneStep(self._sample(chunks))

    def release(self, request_id: str) -> None:
        pass

    def kept_requests(self) -> int:
        return 0


class _EmulatedStep:
    """An emulated step: its tokens are known at once, handed over when the device would be done."""

    def __init__(self, value: StepResult, done_at: float) -> None:
        self.value, self.done_at = value, done_at

    def result(self) -> StepResult:
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)  # sleeping costs no CPU: one core emulates many GPUs
        return self.value


class EmulatedRunner(ZeroRunner):
    """``ZeroRunner``'s tokens, delivered after the time the profile predicts for the step. Like a
    device, it runs launched steps one after another: a step launched while another runs starts
    when that one ends."""

    def __init__(self, config: ModelConfig, kv_cache: torch.Tensor, profile: StepTimeModel) -> None:
        super().__init__(config, kv_cache)
        self.profile = profile
        self._busy_until = 0.0  # perf_counter time the last launched step ends

    def launch(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]) -> StepHandle:
        start = max(time.perf_counter(), self._busy_until)
        self._busy_until = start + self.profile.step_time((c.num_tokens, c.start_pos) for c in chunks)
        return _EmulatedStep(self._sample(chunks), self._busy_until)

    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        requests: Mapping[str, Request],
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        result = self.launch(chunks, requests).result()
        if on_layer is not None:
            for i in range(self.num_layers):
                on_layer(i)
        return result


@dataclass
class Runtime:
    config: EngineConfig
    checkpoint: Checkpoint
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    block_size: int
    kv: KVCacheManager
    runner: StepRunner
    tokenizer: TextTokenizer | None
    profile: StepTimeModel | None = None
    overlap: bool = False  # decode steps overlap (``backend.use_overlap``)
    ranks: RankSetup | None = None  # a tensor-parallel worker's group (and, on rank 0, its ranks)
    grammars: Grammars | None = None  # structured output (rank 0 of a model with a tokenizer)

    def close(self) -> None:
        """Stop the worker's other ranks and leave its group (a TP 1 runtime holds nothing)."""
        if self.grammars is not None:
            self.grammars.close()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.model_config.eos_token_ids)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    def limits(self, max_prompt_tokens: int = 0, max_tokens_cap: int = 0) -> RequestLimits:
        return RequestLimits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            kv_capacity_blocks=self.kv.num_blocks,
            max_logprobs=self.config.max_logprobs,
            has_tokenizer=self.tokenizer is not None,
            max_prompt_tokens=max_prompt_tokens,
            max_tokens_cap=max_tokens_cap,
        )


def _free_kv_blocks(config: EngineConfig, model: ModelConfig, dtype_bytes: int) -> int:  # per rank
    """KV blocks that fit in the device memory free now (after the weights), less the reserve for
    the largest step's activations and the decode graphs."""
    torch.cuda.empty_cache()  # what loading freed counts as free
    free, _ = torch.cuda.mem_get_info()
    splits = attention_tuning.current().decode_splits
    reserve = step_reserve_bytes(
        config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs,
        model.hidden_size,
        model.intermediate_size,
        model.q_size + 2 * model.kv_size,
        model.vocab_size,
        dtype_bytes,
        decode_scratch_bytes(config.scheduler.max_num_seqs, model.num_heads, model.head_dim, splits),
    )
    return kv_blocks_for_free_memory(free, config.cache.block_bytes(model, dtype_bytes), reserve)


def build_runtime(
    config: EngineConfig,
    allocate_cache: CacheAllocator | None = None,
    rank_entry: RankEntry | None = None,
    rank_extra: object = None,
) -> Runtime:
    """The runtime of a worker (of rank 0, for a tensor-parallel one: it starts the other ranks
    as ``rank_entry(args, pipe)``, by default compute-only ranks; ``rank_extra`` reaches them)."""
    return _build(config, allocate_cache, None, rank_entry or follower.main, rank_extra)


def build_rank_runtime(args: RankArgs, allocate_cache: CacheAllocator | None = None) -> Runtime:
    """The runtime of rank ``args.rank`` > 0 of a tensor-parallel worker (no tokenizer, no
    scheduling of its own: it runs the steps rank 0 sends)."""
    if args.threads:
        use_threads(args.threads)
    return _build(args.config, allocate_cache, args, follower.main, None)


def _build(
    config: EngineConfig,
    allocate_cache: CacheAllocator | None,
    rank_args: RankArgs | None,
    rank_entry: RankEntry,
    rank_extra: object,
) -> Runtime:
    rank = rank_args.rank if rank_args is not None else 0
    device = rank_device(torch_device(config), rank) if config.tp > 1 else torch_device(config)
    if device.type == "cpu":
        tune_malloc()
    dtype = resolve_dtype(config.dtype, device)
    checkpoint = resolve_model(config.model)
    model_config = checkpoint.model_config()
    if config.compute == "model":  # (an emulated worker's degree is its profile's)
        check_tp(model_config, config.tp)  # before any process starts: the valid degrees named
    profile = config.profile
    block_size = config.cache.block_size
    t0 = time.perf_counter()
    model = None
    setup: RankSetup | None = None
    if profile is None:
        max_len = min(
            config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )
        kv_config = model_config
        if config.compute == "model":  # weights first: a GPU's KV pool is what they leave free
            backend = choose_backend(device.type, triton_available(), config.backend)
            if config.tp > 1:
                setup = (
                    join_follower(rank_args, model_config, device)
                    if rank_args is not None
                    else start_leader(config, model_config, device, rank_entry, rank_extra)
                )
                kv_config = rank_config(model_config, setup.shard)
            try:
                model = load_model(
                    checkpoint, model_config, device, dtype, max_len, backend,
                    TPRank(setup.shard, setup.group) if setup is not None else None,
                )  # fmt: skip
            except BaseException:
                if setup is not None:
                    setup.close()
                raise
        dtype_bytes = torch.finfo(dtype).bits // 8
        free_blocks = _free_kv_blocks(config, kv_config, dtype_bytes) if device.type == "cuda" else None
        num_blocks = config.cache.resolve_num_blocks(kv_config, dtype_bytes, free_blocks)
        if setup is not None:
            num_blocks = agree_on_blocks(setup, num_blocks)
        shape = kv_cache_shape(kv_config, num_blocks, block_size)
    else:  # the emulated GPU's context and KV capacity, a one-layer stand-in cache
        max_len = min(config.max_model_len or profile.max_model_len, profile.max_model_len)
        num_blocks = config.cache.num_blocks or max(1, profile.kv_capacity_tokens // block_size)
        shape = (1, num_blocks, 2, block_size, 1, 8)
    cache = (
        allocate_cache(shape, dtype, device)
        if allocate_cache is not None
        else new_kv_cache(shape, dtype, device)
    )
    tokenizer = TextTokenizer.load(checkpoint) if rank == 0 else None
    # Only a model's logits can be masked: zero and emulated runners refuse constraints.
    grammars = (
        Grammars(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
        if tokenizer is not None and model is not None and profile is None
        else None
    )
    runner: StepRunner
    if profile is not None:
        runner = EmulatedRunner(model_config, cache, profile)
    elif model is None:
        runner = ZeroRunner(model_config, cache)
    else:
        graphs = None
        # A tensor-parallel step's collectives run eagerly (no graph capture across ranks yet).
        if model.backend is Backend.PAGED and config.cuda_graphs and setup is None:
            # Without CUDA the graphs' fixed-shape inputs still run (eagerly): what tests check.
            graphs = GraphSettings(config.scheduler.max_num_seqs, max_len, capture=device.type == "cuda")
        runner = ModelRunner(
            model_config, model, num_blocks, block_size, kv_cache=cache, graphs=graphs, tp=setup,
            grammars=grammars,
        )  # fmt: skip
        if device.type == "cpu":  # oneDNN's per-shape state, all made now: memory flat from here
            t1 = time.perf_counter()
            ran = model.warm_up(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
            log.debug("warmed up %d linear products in %.2fs", ran, time.perf_counter() - t1)
    rt = Runtime(
        config=config,
        checkpoint=checkpoint,
        model_config=model_config,
        dtype=dtype,
        device=device,
        max_model_len=max_len,
        block_size=block_size,
        kv=KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching),
        runner=runner,
        tokenizer=tokenizer,
        grammars=grammars,
        profile=profile,
        overlap=use_overlap(config.overlap, device.type),
        ranks=setup,
    )
    if rank:
        return rt
    log.info(
        "loaded %s (%s, %s, compute=%s) in %.2fs: %d KV blocks of %d tokens",
        checkpoint.path,
        model_config.architecture,
        dtype,
        config.compute,
        time.perf_counter() - t0,
        num_blocks,
        block_size,
    )
    return rt
