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
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import ClassVar

from pdserve.steptime.model import is_decode_chunk


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

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_capacity_tokens(self) -> int:
        free = max(0.0, self.memory_bytes - self.weight_bytes) * self.kv_memory_fraction
        return int(free // self.kv_bytes_per_token)

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
        kv_read = read * self.kv_bytes_per_token
        linear = max(
            2 * self.params * tokens / (self.peak_flops * self.mfu),
            self.weight_bytes / (self.mem_bw * self.mbu),
        )
        return (
            self.step_overhead_s
            + linear
            + attn_flops / (self.peak_flops * self.mfu_attn)
            + kv_read / (self.mem_bw * self.mbu)
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
        linear = max(
            2 * self.params * batch / (self.peak_flops * self.mfu),
            self.weight_bytes / (self.mem_bw * self.mbu),
        )
        kv_read = batch * (avg + 1) * self.kv_bytes_per_token
        return self.step_overhead_s + linear + kv_read / (self.mem_bw * self.mbu)

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

PROFILES: dict[str, RooflineProfile] = {p.name: p for p in (H100_LLAMA3_8B,)}
