"""The work bound: the highest request rate per GPU that *any* layout, schedule and router could
sustain on a workload without shedding requests (pure Python).

Every token of every request must pass through some forward pass, and a pass never costs less
than the marginal cost of its tokens in a large compute-bound step: the linear layers' FLOPs,
the prompt's attention FLOPs and, for each decode token, the KV reads of its context. What a
step's base cost covers (the weight reads of a memory-bound step, the fixed per-step overhead)
can be shared by any number of tokens, so the bound charges none of it: it is what perfect
batching and perfect overlap of prefill and decode would reach. Prefix-cache hits are counted as
if the cache were infinite (a block any earlier prompt had is free), so the bound stays an upper
bound on workloads with shared prefixes.

With tensor parallelism the bound is in GPU-seconds at the smallest degree the model runs at:
the linear, attention and KV-read work a token does on ``t`` GPUs takes ``t`` times its step share
in GPU-seconds, the same at every degree, while the all-reduces (and replicated KV heads past
``kv_heads``) only add with ``t``, so no degree does a token's work in fewer GPU-seconds.

Two uses: a simulated or measured goodput reads against it (how close to the hardware a layout
gets), and a target above it is out of reach for every router unless requests are shed, since in
steady state the work arriving per second must fit in the GPU-seconds available. Finite runs can
exceed it briefly: a backlog that builds during the arrivals drains after them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.bench.workload import RequestSpec
from pdserve.simulator.prompt_memo import prompt_keys
from pdserve.steptime.model import StepTimeModel
from pdserve.steptime.parallel import at_tp, valid_tp

# Marginal costs are taken inside a step this large: compute-bound for any profile, with a
# prefill chunk and a decode token already present so that neither kind's base cost is charged.
_BASE: tuple[tuple[int, int], ...] = ((4096, 0), (1, 1024))


@dataclass(frozen=True)
class WorkBound:
    requests: int
    prefill_s: float  # mean GPU-seconds of prefill work per request
    decode_s: float  # mean GPU-seconds of decode work per request
    cached_fraction: float  # of prompt tokens, free under an infinite prefix cache

    @property
    def seconds_per_request(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def rate_per_gpu(self) -> float:
        """Requests per second per GPU no layout can exceed in steady state without shedding."""
        s = self.seconds_per_request
        return 1.0 / s if s > 0 else float("inf")


class MarginalCost:
    """Marginal step cost of a prompt chunk and of a decode token under one latency model."""

    def __init__(self, model: StepTimeModel) -> None:
        self.model = model
        self._base = model.step_time(_BASE)
        # A decode token's marginal cost is affine in its context for every profile kind (KV
        # reads, or the fitted form's b·ctx + c), so two points give it exactly.
        self._d0 = self._extra(((1, 1024),))
        self._d1 = (self._extra(((1, 2048),)) - self._d0) / 1024

    def _extra(self, chunks: tuple[tuple[int, int], ...]) -> float:
        return max(0.0, self.model.step_time(_BASE + chunks) - self._base)

    def prefill(self, new_tokens: int, cached_tokens: int) -> float:
        return self._extra(((new_tokens, cached_tokens),)) if new_tokens > 0 else 0.0

    def decode(self, prompt_len: int, output_len: int) -> float:
        """Decode tokens 2..output_len (the first comes with the prefill): each follows a cached
        context of prompt_len .. prompt_len + output_len - 2 tokens."""
        n = max(0, output_len - 1)
        if n == 0:
            return 0.0
        mean_cached = prompt_len + (n - 1) / 2
        return n * max(0.0, self._d0 + self._d1 * (mean_cached - 1024))


def work_bound(model: StepTimeModel, specs: Sequence[RequestSpec], block_size: int = 16) -> WorkBound:
    """The work bound of ``specs`` on ``model`` at any degree (see the module docstring)."""
    tp = valid_tp(model)[0]
    cost = MarginalCost(at_tp(model, tp))
    seen: set[bytes] = set()
    prefill = decode = 0.0
    prompt_tokens = cached_tokens = 0
    for s in specs:
        cached = 0
        if isinstance(s.prompt, tuple):
            keys = prompt_keys(s.prompt, block_size)
            hit = 0
            for k in keys:
                if k not in seen:
                    break
                hit += 1
            seen.update(keys)
            cached = min(hit * block_size, s.prompt_len - 1)
        prefill += cost.prefill(s.prompt_len - cached, cached)
        decode += cost.decode(s.prompt_len, s.output_len)
        prompt_tokens += s.prompt_len
        cached_tokens += cached
    n = len(specs)
    return WorkBound(
        requests=n,
        prefill_s=tp * prefill / n if n else 0.0,  # GPU-seconds: each of the tp GPUs held
        decode_s=tp * decode / n if n else 0.0,
        cached_fraction=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
    )
