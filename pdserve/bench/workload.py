"""Requests to send and when: lengths, arrival processes, trace files (pure Python).

Arrivals: Poisson at ``rate`` or gamma with shape ``burstiness`` (burstiness = 1/CV²; 1 is
Poisson, < 1 burstier), as ``vllm bench serve`` draws them; ``rate = inf`` sends all at once.
Traces keep their own timestamps, divided by ``time_scale`` (2 = twice as fast).
Prefix reuse: a JSONL trace may give ``hash_ids`` (one id per block of ``block_size`` tokens,
Mooncake style); equal ids become equal token blocks, so prefix caches see the same reuse.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float  # offset from the start of the run
    prompt: tuple[int, ...] | str
    prompt_len: int
    output_len: int


class WorkloadError(ValueError):
    pass


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """``n`` arrival offsets: gamma inter-arrivals with mean 1/rate and shape ``burstiness``."""
    if n < 0:
        raise WorkloadError("the number of requests must be >= 0")
    if math.isinf(rate):
        return [0.0] * n
    if not (rate > 0 and 0 < burstiness < math.inf):  # NaN too
        raise WorkloadError(
            f"request rate and burstiness must be > 0 (burstiness finite), got {rate} and {burstiness}"
        )
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, theta)
        out.append(t)
    return out


def random_prompt(n: int, vocab: int, rng: random.Random) -> tuple[int, ...]:
    # Avoid the lowest ids, where small vocabularies keep their special tokens.
    low = min(16, vocab - 1)
    return tuple(rng.choices(range(low, vocab), k=n))


def length_pairs_random(
    n: int, input_len: int, output_len: int, range_ratio: float, rng: random.Random
) -> list[tuple[int, int]]:
    """Uniform lengths in [len·(1-r), len·(1+r)] (r = 0: fixed lengths), as vLLM's random set."""
    if not 0 <= range_ratio < 1:
        raise WorkloadError("--random-range-ratio must be in [0, 1)")
    if input_len < 1 or output_len < 1:  # they were drawn as 1 token, silently
        raise WorkloadError(
            f"--random-input-len and --random-output-len must be >= 1, got {input_len}, {output_len}"
        )

    def draw(x: int) -> int:
        lo, hi = max(1, int(x * (1 - range_ratio))), max(1, int(x * (1 + range_ratio)))
        return rng.randint(lo, hi)

    return [(draw(input_len), draw(output_len)) for _ in range(n)]


def read_sharegpt_lengths(path: Path) -> list[tuple[int, int]]:
    """(input, output) lengths from a CSV with ``num_prefill_tokens, num_decode_tokens``."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = {"num_prefill_tokens", "num_decode_tokens"}
        if not need <= set(reader.fieldnames or ()):
            raise WorkloadError(f"{path}: expected columns {sorted(need)}, found {reader.fieldnames}")
        return [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in reader]


@dataclass(frozen=True)
class TraceRow:
    timestamp_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def read_trace(path: Path) -> list[TraceRow]:
    """The Azure LLM inference CSV (``TIMESTAMP, ContextTokens, GeneratedTokens``) or a JSONL of
    ``{"timestamp", "input_length", "output_length"[, "hash_ids"]}`` (timestamps in ms)."""
    if path.suffix == ".jsonl":
        return list(_read_jsonl(path))
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or ()):
            raise WorkloadError(f"{path}: expected Azure trace columns {sorted(need)}")
        rows = []
        t0: datetime | None = None
        for r in reader:
            ts = datetime.fromisoformat(r["TIMESTAMP"][:26])
            t0 = t0 or ts
            rows.append(
                TraceRow((ts - t0).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            )
        return rows


def _read_jsonl(path: Path) -> Iterator[TraceRow]:
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                yield TraceRow(
                    float(r["timestamp"]) / 1000.0,
                    int(r["input_length"]),
                    int(r["output_length"]),
                    tuple(int(h) for h in r.get("hash_ids", ())),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise WorkloadError(f"{path}:{lineno}: {e}") from None


def loop_trace(rows: Sequence[TraceRow], n: int, start: int = 0) -> list[TraceRow]:
    """``n`` rows of the trace from row ``start`` on, the trace again after its end as often as
    needed (so a start row near the end wraps around to the beginning).

    A lap starts one mean inter-arrival gap after the previous one ends, so the rate stays the
    trace's own. Each lap gets its own block hashes: a replayed conversation would otherwise hit
    the prefix cache its first lap filled, which the real workload never offered. Different
    start rows are what varies a trace replay between runs (its lengths and arrivals are fixed).
    """
    if not rows:
        return []
    if not 0 <= start < len(rows):
        raise WorkloadError(f"--trace-start {start} is outside the trace's {len(rows)} rows")
    span = rows[-1].timestamp_s - rows[0].timestamp_s
    period = span + (span / (len(rows) - 1) if len(rows) > 1 else 1.0)
    hashes = [h for r in rows for h in r.hash_ids]
    stride = (max(hashes) - min(hashes) + 1) if hashes else 0
    out: list[TraceRow] = []
    for i in range(start, start + n):
        lap, r = divmod(i, len(rows))
        row = rows[r]
        out.append(
            TraceRow(
                row.timestamp_s + lap * period,
                row.input_len,
                row.output_len,
                tuple(h + lap * stride for h in row.hash_ids),
            )
        )
    return out


def trace_prompts(
    rows: Sequence[TraceRow], vocab: int, block_size: int, rng: random.Random
) -> list[tuple[int, ...]]:
    """A prompt per row: rows sharing a prefix hash share those blocks' tokens."""
    blocks: dict[int, tuple[int, ...]] = {}
    out = []
    for r in rows:
        if r.hash_ids:
            prompt: list[int] = []
            for h in r.hash_ids:
                if h not in blocks:
                    blocks[h] = random_prompt(block_size, vocab, rng)
                prompt.extend(blocks[h])
            ids = (
                tuple(prompt[: r.input_len])
                if len(prompt) >= r.input_len
                else tuple(prompt + list(random_prompt(r.input_len - len(prompt), vocab, rng)))
            )
        else:
            ids = random_prompt(r.input_len, vocab, rng)
        out.append(ids)
    return out


def trace_requests(
    rows: Sequence[TraceRow],
    n: int,
    time_scale: float,
    vocab: int,
    block_size: int,
    rng: random.Random,
    prompts: Sequence[tuple[int, ...]] | None = None,
) -> list[RequestSpec]:
    """The first ``n`` rows as requests, arrivals relative to the first and sped up by
    ``time_scale``. ``prompts``: ``trace_prompts`` of those rows made earlier (they do not
    depend on the rate), else made here from ``rng``."""
    if not time_scale > 0:  # NaN too
        raise WorkloadError(f"--time-scale must be > 0, got {time_scale}")
    rows = list(rows[:n])
    if not rows:
        return []
    ids = trace_prompts(rows, vocab, block_size, rng) if prompts is None else prompts
    start = rows[0].timestamp_s
    return [
        RequestSpec((r.timestamp_s - start) / time_scale, p, r.input_len, r.output_len)
        for r, p in zip(rows, ids, strict=True)
    ]


def synthetic_requests(
    lengths: Sequence[tuple[int, int]], arrivals: Sequence[float], vocab: int, rng: random.Random
) -> list[RequestSpec]:
    return [
        RequestSpec(t, random_prompt(i, vocab, rng), i, o)
        for (i, o), t in zip(lengths, arrivals, strict=True)
    ]


class RateCurve:
    """A piecewise-linear multiplier of the mean rate over the run: ``"0:1,600:4,1200:1"`` is
    the rate, 4x the rate at 10 minutes, the rate again at 20 (flat after the last point).

    ``warp`` moves arrivals drawn at the constant rate (Poisson, gamma or a trace's own
    pattern) onto the curve: an arrival at ``τ`` goes to the ``t`` where the multiplier's
    integral reaches ``τ``, so bursts keep their shape and the rate follows the curve.
    """

    def __init__(self, points: Sequence[tuple[float, float]]) -> None:
        pts = sorted(points)
        if not pts or pts[0][0] != 0:
            raise WorkloadError("a rate curve starts at time 0")
        if any(not (math.isfinite(t) and math.isfinite(x) and x > 0) for t, x in pts):
            raise WorkloadError("rate-curve multipliers must be finite and > 0")
        if len({t for t, _ in pts}) != len(pts):
            raise WorkloadError("rate-curve times must differ")
        self.points = pts

    @classmethod
    def parse(cls, text: str) -> RateCurve:
        try:
            pts = [(float(t), float(x)) for t, x in (p.split(":") for p in text.split(",") if p.strip())]
        except ValueError:
            raise WorkloadError(f"rate curve {text!r}: expected T:MULTIPLIER[,T:MULTIPLIER...]") from None
        return cls(pts)

    def multiplier(self, t: float) -> float:
        pts = self.points
        for (t0, x0), (t1, x1) in itertools.pairwise(pts):
            if t < t1:
                return x0 + (x1 - x0) * (t - t0) / (t1 - t0)
        return pts[-1][1]

    def integral(self, t: float) -> float:
        """∫₀ᵗ multiplier."""
        total, pts = 0.0, self.points
        for (t0, x0), (t1, _) in itertools.pairwise(pts):
            if t <= t0:
                return total
            end = min(t, t1)
            total += (end - t0) * (x0 + self.multiplier(end)) / 2
            if t <= t1:
                return total
        return total + (t - pts[-1][0]) * pts[-1][1] if t > pts[-1][0] else total

    def warp(self, tau: float) -> float:
        """The ``t`` with ``integral(t) == tau``."""
        pts, done = self.points, 0.0
        for (t0, x0), (t1, x1) in itertools.pairwise(pts):
            seg = (t1 - t0) * (x0 + x1) / 2
            if tau <= done + seg:
                # solve x0·u + (x1 − x0)/(2h)·u² = tau − done for u in [0, h]
                h, need, k = t1 - t0, tau - done, (x1 - x0) / (2 * (t1 - t0))
                u = need / x0 if abs(k) < 1e-15 else (-x0 + math.sqrt(x0 * x0 + 4 * k * need)) / (2 * k)
                return t0 + min(h, max(0.0, u))
            done += seg
        return pts[-1][0] + (tau - done) / pts[-1][1]


def rate_curve(args: argparse.Namespace) -> RateCurve | None:
    text = getattr(args, "rate_curve", None)
    if not text:
        return None
    if not math.isfinite(args.request_rate):
        raise WorkloadError("--rate-curve shapes --request-rate: give a finite rate")
    return RateCurve.parse(text)


def num_prompts(args: argparse.Namespace) -> int:
    """``--num-prompts``, or enough to cover ``--duration`` seconds of arrivals at the rate
    (along ``--rate-curve``, if given)."""
    duration = getattr(args, "duration", 0.0) or 0.0
    if not 0 <= duration < math.inf:  # NaN too: it was ignored, the count taken instead
        raise WorkloadError(f"--duration must be a finite number of seconds >= 0 (0: none), got {duration}")
    if duration > 0 and math.isfinite(args.request_rate):
        curve = rate_curve(args)
        seconds = curve.integral(duration) if curve else duration
        return max(int(args.num_prompts), math.ceil(float(args.request_rate) * seconds))
    return int(args.num_prompts)
