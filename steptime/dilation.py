"""Time dilation for emulated GPUs: every predicted duration stretched by a factor (pure Python).

Emulated workers sleep for the time a GPU would take, while the router, Ray, gRPC, the KV
transport and the workers' Python loops run for real on the host. At cluster-scale rates those
host costs — fixed per request and per token, not per GPU-second — become the bottleneck of a
small host and the measurement stops describing the emulated GPUs. Stretching the GPU's time by
``factor`` (and the offered rate and SLOs with it) leaves the emulated cluster's queueing the
same in GPU time while dividing the host's share by ``factor``: the standard time-dilation trick
of network emulation. Measured latencies are divided by ``factor`` to read in GPU time. Name it
``<profile>@x<factor>`` wherever a profile is accepted, e.g. ``emulated:h100-llama3-8b@x4``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.steptime.model import StepTimeModel, Wrapper

_SUFFIX = re.compile(r"^(?P<base>.+)@x(?P<factor>\d+(?:\.\d+)?)$")


def split_dilation(name: str) -> tuple[str, float]:
    """``"h100-llama3-8b@x4"`` -> ``("h100-llama3-8b", 4.0)``; no suffix -> factor 1."""
    m = _SUFFIX.match(name)
    if m is None:
        return name, 1.0
    factor = float(m["factor"])
    if not 1.0 <= factor <= 1000.0:
        raise ValueError(f"time dilation factor must be within 1..1000, got {factor:g} in {name!r}")
    return m["base"], factor


@dataclass(frozen=True)
class Dilated(Wrapper):
    """``base`` with every duration multiplied by ``factor``; capacities unchanged."""

    base: StepTimeModel
    factor: float

    @property
    def name(self) -> str:
        return f"{self.base.name}@x{self.factor:g}"

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        return self.factor * self.base.step_time(chunks)

    def mixed_time(self, chunks: Iterable[tuple[int, int]], decodes: int, decode_context: int) -> float:
        return self.factor * self.base.mixed_time(chunks, decodes, decode_context)

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.factor * self.base.prefill_time(new_tokens, cached_tokens)

    def decode_time(self, batch: int, total_context: int) -> float:
        return self.factor * self.base.decode_time(batch, total_context)

    def transfer_time(self, tokens: int) -> float:
        return self.factor * self.base.transfer_time(tokens)

    def to_json(self) -> str:
        return json.dumps({"kind": "dilated", "factor": self.factor, "base": json.loads(self.base.to_json())})
