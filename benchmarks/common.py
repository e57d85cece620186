"""Helpers shared by benchmark scripts: timing, machine ceilings, and the final JSON line."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], object], repeat: int = 5, warmup: int = 1, device: torch.device | None = None
) -> float:
    dev = device or torch.device("cpu")
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_read_bandwidth(device: torch.device, mib: int = 512) -> float:
    """Bytes/s of a streaming read (a sum over a buffer far larger than any cache)."""
    x = torch.ones(mib * (1 << 20) // 4, device=device)
    return x.numel() * 4 / median_time(lambda: x.sum(), repeat=9, warmup=2, device=device)


def memory_copy_bandwidth(device: torch.device, mib: int = 512) -> float:
    """Bytes/s moved by a large copy, counting the read and the write."""
    x = torch.ones(mib * (1 << 20) // 4, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / median_time(lambda: y.copy_(x), repeat=9, warmup=2, device=device)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 2048) -> dict[str, float]:
    """FLOP/s of an n x n x n product: torch.matmul, and on CPU oneDNN's where available."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = {"matmul": 2 * n**3 / median_time(lambda: a @ b, repeat=7, warmup=2, device=device)}
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(b, 32)

            def onednn() -> torch.Tensor:
                product: torch.Tensor = torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
                return product

            out["onednn"] = 2 * n**3 / median_time(onednn, repeat=7, warmup=2)
        except (RuntimeError, AttributeError):
            pass
    return out


def emit(result: dict[str, Any]) -> None:
    """Print the result as the final line of output (one JSON object)."""
    print(json.dumps(result, sort_keys=True), flush=True)
