"""From what the client saw to the field's numbers, named as ``vllm bench serve`` names them
(pure Python).

Per request (field notes §2): TTFT = first token - send; TPOT = (last - first token) / (output
tokens - 1), undefined for one output token (then only TTFT and E2E count for it); ITL = every
gap between tokens; E2E = last token - send. SLO attainment is joint (TTFT and TPOT [and E2E]
all met) over *all* requests: failed and rejected ones are misses. ``request_goodput`` is
requests meeting every SLO per second, as vLLM reports it.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2E seconds
    error: str = ""
    rejected: bool = False  # the server said "not now" (429 / RESOURCE_EXHAUSTED)

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class Slo:
    """Targets in milliseconds; 0 leaves a metric unconstrained."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2el_ms: float = 0.0

    @staticmethod
    def parse(items: Sequence[str]) -> Slo:
        """``["ttft:250", "tpot:100", "e2el:5000"]`` as ``--goodput`` takes them."""
        values: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
            try:
                v = float(value)
            except ValueError:
                raise ValueError(f"--goodput {name}: {value!r} is not a number of milliseconds") from None
            if not 0 < v < math.inf:  # NaN too
                raise ValueError(f"--goodput {name}: must be a finite number > 0 ms, got {value}")
            values[f"{name}_ms"] = v
        return Slo(**values)

    @property
    def empty(self) -> bool:
        return not (self.ttft_ms or self.tpot_ms or self.e2el_ms)

    def met(self, r: RequestResult) -> bool:
        if not r.success:
            return False
        if self.ttft_ms and r.ttft * 1000 > self.ttft_ms:
            return False
        tpot = r.tpot
        if self.tpot_ms and tpot is not None and tpot * 1000 > self.tpot_ms:
            return False
        return not (self.e2el_ms and r.latency * 1000 > self.e2el_ms)


def _percentile(xs: Sequence[float], q: float, presorted: bool = False) -> float:
    """Linear interpolation between closest ranks (numpy's default), so results match vLLM's."""
    if not xs:
        return 0.0
    s = xs if presorted else sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(name: str, xs_s: Sequence[float], out: dict[str, Any]) -> None:
    # Sorted once for the median and every percentile: a run's inter-token latencies are one
    # value per generated token (hundreds of thousands in a simulated point).
    ms = sorted(x * 1000 for x in xs_s)
    n = len(ms)
    mean = statistics.fmean(ms) if ms else 0.0
    out[f"mean_{name}_ms"] = mean
    out[f"median_{name}_ms"] = (ms[n // 2] if n % 2 else (ms[n // 2 - 1] + ms[n // 2]) / 2) if ms else 0.0
    # the population deviation in floats (statistics.pstdev computes in exact fractions:
    # seconds for a few hundred thousand values)
    out[f"std_{name}_ms"] = math.sqrt(math.fsum((x - mean) ** 2 for x in ms) / n) if n > 1 else 0.0
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = _percentile(ms, p, presorted=True)


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> dict[str, Any]:
    done = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    good = sum(1 for r in results if slo.met(r)) if not slo.empty else len(done)
    dur = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "rejected": sum(1 for r in results if r.rejected),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / dur,
        "request_goodput": good / dur if not slo.empty else None,
        "slo_attainment": good / len(results) if results and not slo.empty else None,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
    }
    _stats("ttft", [r.ttft for r in done], out)
    _stats("tpot", [t for r in done if (t := r.tpot) is not None], out)
    _stats("itl", [x for r in done for x in r.itls], out)
    _stats("e2el", [r.latency for r in done], out)
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_len for r in results]
    out["ttfts"] = [r.ttft if r.success else 0.0 for r in results]
    out["itls"] = [r.itls for r in results]
    out["errors"] = [r.error for r in results]
    return out


def failure_causes(errors: Sequence[str]) -> list[tuple[str, int]]:
    """Each distinct error with the requests that failed with it, the most frequent first (ties
    in order of first appearance): what went wrong, counted, rather than the first error alone."""
    return Counter(e for e in errors if e).most_common()
