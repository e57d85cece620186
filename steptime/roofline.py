"""How long a step takes on a given GPU: a roofline model of one GPU (pure Python).

One forward pass over a packed batch is modelled without assuming that attention hides under
the GEMMs (it does not: attention kernels run after the projections that feed them):

    t = overhead + max(linear FLOPs / (peak · mfu), weight bytes / (bandwidth · mbu))
          + attention FLOPs of prefill chunks / (peak · mfu_attn)
          + KV bytes the decodes read / (bandwidth · mbu)

Linear FLOPs are 2 · parameters per token; a prefill chunk of ``n`` new tokens after ``c``
cached ones does ``4 · layers · heads · head_dim · n · (c + n/2)`` attention FLOPs; a decode
token reads its whole context's KV. A KV transfer of ``n`` tokens takes ``latency + n · KV
bytes per token / link bandwidth``.

The built-in ``h100-llama3-8b`` is calibrated on published kernel measurements: a 2,048-token
prefill ≈ 47 ms (mfu ≈ 0.72) and a batch-1 decode step ≈ 6.6 ms (mbu ≈ 0.75); its link is
NVLink-class (NCCL send/recv ≈ 100 GB/s).

**Tensor parallelism.** A worker of degree ``tp`` spans ``tp`` GPUs (Megatron-style): each rank
holds ``1/tp`` of the weights and ``ceil(kv_heads / tp)`` KV heads (one head, replicated, when
``kv_heads < tp``), so the linear and attention terms and the weight reads divide by ``tp``, a
decode token reads its rank's heads only, and the KV pool is what ``tp`` GPUs leave free per
rank. Each layer adds two ring all-reduces of the step's hidden states (``hidden · tokens ·
dtype`` bytes), each ``2 (tp − 1) / tp · bytes / tp_link_bw + tp_link_latency_s``. At ``tp = 1``
every term is exactly the single-GPU model's. A KV hand-off between workers keeps the worker's
link (``link_bw``): ranks that send in parallel are not modelled. ``at_tp`` gives the profile at
another degree, named ``<name>@tp<N>`` (what ``load_profile`` reads back); a degree whose weights
leave no room for KV is refused, naming the degrees that fit (``valid_tp``).

The built-in ``h100-llama3-70b`` (Llama-3-70B's shape on H100s, all-reduce over NVLink at
≈ 450 GB/s a direction) needs ``tp >= 2``: its weights alone take 141 GB.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import ClassVar

from pdserve.steptime.model import is_decode_chunk

TP_DEGREES = (1, 2, 4, 8)  # the degrees a worker may span (GPUs of one NVLink node)
_TP_SUFFIX = re.compile(r"^(?P<base>.+)@tp(?P<tp>\d+)$")


def split_tp(name: str) -> tuple[str, int | None]:
    """``"h100-llama3-70b@tp4"`` -> ``("h100-llama3-70b", 4)``; no suffix -> ``(name, None)``."""
    m = _TP_SUFFIX.match(name)
    return (name, None) if m is None else (m["base"], int(m["tp"]))


@dataclass(frozen=True)
class RooflineProfile:
    KIND: ClassVar[str] = "roofline"

    name: str
    # model
    params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_model_len: int
    # hardware
    peak_flops: float
    mem_bw: float  # bytes/s
    memory_bytes: float  # per GPU
    link_bw: float  # bytes/s between two workers
    link_latency_s: float
    # efficiencies
    mfu: float = 0.72
    mfu_attn: float = 0.5
    mbu: float = 0.75
    step_overhead_s: float = 0.0002
    kv_memory_fraction: float = 0.9  # of what the weights leave free
    # tensor parallelism (see the module docstring)
    tp: int = 1  # GPUs the worker spans
    tp_link_bw: float = 450e9  # bytes/s a direction between a node's GPUs (all-reduce)
    tp_link_latency_s: float = 10e-6  # per all-reduce

    def __post_init__(self) -> None:
        if not (self.tp >= 1 and self.heads % self.tp == 0):
            raise ValueError(f"tp must be >= 1 and divide the {self.heads} attention heads, got {self.tp}")
        if not (self.tp_link_bw > 0 and self.tp_link_latency_s >= 0):
            raise ValueError("tp_link_bw must be > 0 and tp_link_latency_s >= 0")

    @property
    def hidden_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_heads_per_rank(self) -> int:
        """A rank's KV heads: its share, or one replicated head when ``kv_heads < tp``."""
        return -(-self.kv_heads // self.tp)

    @property
    def kv_bytes_per_rank_token(self) -> int:
        """What a token's KV takes on each rank (the worker's pools are per rank)."""
        return self._rank_token_bytes(self.tp)

    def _rank_token_bytes(self, tp: int) -> int:
        return 2 * self.layers * -(-self.kv_heads // tp) * self.head_dim * self.dtype_bytes

    def _capacity(self, tp: int) -> int:
        free = (self.memory_bytes - self.weight_bytes / tp) * self.kv_memory_fraction
        return int(free // self._rank_token_bytes(tp))

    def fits(self, tp: int) -> bool:
        """At degree ``tp`` the weights leave room for KV on each rank."""
        return tp >= 1 and self.heads % tp == 0 and self._capacity(tp) > 0

    def valid_tp(self) -> tuple[int, ...]:
        """The degrees of ``TP_DEGREES`` this model runs at."""
        return tuple(t for t in TP_DEGREES if self.fits(t))

    def check_fits(self) -> None:
        if not self.fits(self.tp):
            valid = ", ".join(map(str, self.valid_tp())) or "none"
            raise ValueError(
                f"{self.name} does not fit at tp={self.tp}: {self.weight_bytes / 1e9:.0f} GB of weights over "
                f"{self.tp} GPU(s) of {self.memory_bytes / 1e9:.0f} GB leave no room for KV; valid "
                f"degrees: {valid}"
            )

    def at_tp(self, tp: int) -> RooflineProfile:
        """This model on workers of ``tp`` GPUs (named ``<name>@tp<tp>``); refused where it does
        not fit."""
        base, _ = split_tp(self.name)
        if tp < 1 or self.heads % tp:
            raise ValueError(f"tp must be >= 1 and divide the {self.heads} attention heads, got {tp}")
        at = self if tp == self.tp else replace(self, tp=tp, name=base if tp == 1 else f"{base}@tp{tp}")
        at.check_fits()
        return at

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens each rank's pool holds (the worker's: every rank holds every token)."""
        self.check_fits()
        return self._capacity(self.tp)

    def _all_reduce(self, tokens: int) -> float:
        """Two ring all-reduces of the hidden states a layer (none on one GPU)."""
        if self.tp == 1:
            return 0.0
        nbytes = self.hidden_size * tokens * self.dtype_bytes
        one = 2 * (self.tp - 1) / self.tp * nbytes / self.tp_link_bw + self.tp_link_latency_s
        return 2 * self.layers * one

    def _linear(self, tokens: int) -> float:
        return max(
            2 * self.params * tokens / (self.tp * self.peak_flops * self.mfu),
            self.weight_bytes / (self.tp * self.mem_bw * self.mbu),
        )

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """One forward pass over ``(new tokens, tokens already cached)`` per request."""
        return self.mixed_time(chunks, 0, 0)

    def mixed_time(self, chunks: Iterable[tuple[int, int]], decodes: int, decode_context: int) -> float:
        # context tokens the decodes read (a decode token reads its whole context and itself)
        tokens, read = decodes, decode_context + decodes
        attn_flops = 0.0
        per_layer = 4 * self.layers * self.heads * self.head_dim
        for new, cached in chunks:
            tokens += new
            if is_decode_chunk(new, cached):
                read += cached + 1
            else:
                attn_flops += per_layer * new * (cached + new / 2)
        if tokens == 0:
            return 0.0
        kv_read = read * self.kv_bytes_per_rank_token
        return (
            self.step_overhead_s
            + self._linear(tokens)
            + attn_flops / (self.tp * self.peak_flops * self.mfu_attn)
            + kv_read / (self.mem_bw * self.mbu)
            + self._all_reduce(tokens)
        )

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.step_time([(new_tokens, cached_tokens)])

    def decode_time(self, batch: int, total_context: int) -> float:
        """A decode step for ``batch`` requests whose contexts sum to ``total_context``."""
        if batch == 0:
            return 0.0
        avg = int(total_context / batch)
        if avg == 0:
            return self.step_time([(1, 0)] * batch)
        # step_time of ``batch`` decode tokens, in closed form (routers call this per option)
        kv_read = batch * (avg + 1) * self.kv_bytes_per_rank_token
        return (
            self.step_overhead_s
            + self._linear(batch)
            + kv_read / (self.mem_bw * self.mbu)
            + self._all_reduce(batch)
        )

    def transfer_time(self, tokens: int) -> float:
        return self.link_latency_s + tokens * self.kv_bytes_per_token / self.link_bw

    def to_json(self) -> str:
        return json.dumps({"kind": self.KIND, **asdict(self)}, indent=2)


H100_LLAMA3_8B = RooflineProfile(
    name="h100-llama3-8b",
    params=8.03e9,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    dtype_bytes=2,
    max_model_len=131072,
    peak_flops=989e12,
    mem_bw=3.35e12,
    memory_bytes=80e9,
    link_bw=100e9,
    link_latency_s=50e-6,
)

# Llama-3-70B's shape (GQA: 8 KV heads) on the same H100s: fits at tp >= 2 only.
H100_LLAMA3_70B = dataclasses.replace(
    H100_LLAMA3_8B, name="h100-llama3-70b", params=70.6e9, layers=80, heads=64, kv_heads=8
)

PROFILES: dict[str, RooflineProfile] = {p.name: p for p in (H100_LLAMA3_8B, H100_LLAMA3_70B)}
