"""The attention kernels' settings, swept on a GPU.

Times the paged attention kernels alone for one layer of a Llama-3.1-8B shape (32 query heads,
8 KV heads, dimension 128, bf16, 16-token blocks scattered through the cache):

* **decode** (split + merge) at batch x context shapes from one short row to many long ones,
  over split policies ``(num_splits, min_split_tokens)`` (``attention_tuning``; ``capacity`` is
  the earlier grid, a split per 256 positions of an 8k limit) and launch settings
  (``DecodeLaunch``: positions a tile, warps, pipeline stages);
  bandwidth = the KV bytes the rows attend to over the time, against the device copy rate;
* **prefill** (causal, varlen) for a fresh 2k and 8k prompt and a 2k chunk continuing a 6k
  cached prefix, over ``PrefillLaunch`` (query rows a program, keys a tile, warps, stages);
  FLOP/s = 4 x dimension x query heads x the (query, key) pairs attended, against the same run's
  bf16 matmul.

Each setting's time is a CUDA graph's replay (no launch gaps). Settings are ranked by the
geometric mean over shapes of their time over the shape's best; the defaults' rank is reported.

Run: ``python -m benchmarks.attention_kernels [--out DIR]`` (``$OUT`` when set; about two
minutes on an H200, most of it compiling); ``--dry-run`` runs a tiny sweep under Triton's
interpreter on the CPU (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import matmul_flops, median_time, memory_copy_bandwidth
from pdserve.model_runtime.attention_tuning import DEFAULT, AttentionTuning, DecodeLaunch, PrefillLaunch
from pdserve.model_runtime.kernels import paged_attention as pa
from pdserve.model_runtime.kv_cache.tensors import new_kv_cache

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
CAPACITY_LIMIT = 8192 + 64  # the GPU check's context limit: the capacity grid's width
SCALE = DIM**-0.5


def _time(fn: Callable[[], object], cuda: bool) -> float:
    """Median seconds of ``fn``: replays of a CUDA graph of 10 ms of calls on a GPU."""
    if not cuda:
        return median_time(fn, repeat=2, warmup=1)
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=10, return_mode="median")) / 1e3


def _rank(results: dict[str, dict[str, float]], shapes: list[str]) -> tuple[list[str], dict[str, float]]:
    """Settings timed at every shape, best first by the geometric mean of time / shape's best."""
    complete = {k: v for k, v in results.items() if all(s in v for s in shapes)}
    best = {s: min(v[s] for v in complete.values()) for s in shapes}
    score = {
        k: math.exp(sum(math.log(v[s] / best[s]) for s in shapes) / len(shapes)) for k, v in complete.items()
    }
    return sorted(score, key=score.__getitem__), score


class Sweep:
    """One kernel's settings over its shapes: times, errors (a setting the device cannot
    compile, e.g. out of shared memory, is skipped), the ranking."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.ms: dict[str, dict[str, float]] = {}
        self.errors: dict[str, str] = {}
        self.shapes: list[str] = []

    def time(self, name: str, shape: str, fn: Callable[[], object]) -> None:
        if shape not in self.shapes:
            self.shapes.append(shape)
        try:
            self.ms.setdefault(name, {})[shape] = _time(fn, self.cuda) * 1e3
        except Exception as e:
            self.errors[name] = f"{type(e).__name__}: {e}"[:300]

    def best(self, shape: str) -> float:
        return min((v[shape] for v in self.ms.values() if shape in v), default=math.nan)

    def report(self, default: str, work: Mapping[str, float], ceiling: float) -> dict[str, Any]:
        """``work``: bytes or FLOPs per shape; ``ceiling``: the same unit per second."""
        ranked, score = _rank(self.ms, self.shapes)
        for k in ranked[:8]:
            print(f"  {score[k]:.3f} {k} " + " ".join(f"{self.ms[k][s] * 1e3:.0f}us" for s in self.shapes))
        return {
            "shapes": self.shapes,
            "best_us": {s: self.best(s) * 1e3 for s in self.shapes},
            "best_of_ceiling": {s: work[s] / (self.best(s) / 1e3) / ceiling for s in self.shapes},
            "default": default,
            "default_score": score.get(default),
            "default_rank": ranked.index(default) + 1 if default in ranked else None,
            "ranked": [[k, score[k]] for k in ranked],
            "ms": {k: self.ms[k] for k in ranked},
            "errors": self.errors,
        }


def _cache(tokens: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    cache = new_kv_cache((1, tokens // BLOCK + 1, 2, BLOCK, KV_HEADS, DIM), dtype, device)
    cache.normal_(generator=gen)
    return cache[0]


def _tables(rows: int, per_row: int, width: int, blocks: int, gen: torch.Generator) -> torch.Tensor:
    """``rows`` block tables of ``per_row`` distinct scattered blocks, ``width`` wide."""
    device = gen.device
    perm = torch.randperm(blocks - 1, generator=gen, device=device)[: rows * per_row].to(torch.int32) + 1
    tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
    tables[:, :per_row] = perm.view(rows, per_row)
    return tables


def decode_sweep(cuda: bool, dtype: torch.dtype, device: torch.device, copy: float) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    if cuda:
        shapes = [(1, 1024), (64, 1024), (256, 1024), (16, 8192), (1, 32768)]
        policies: list[tuple[int, int] | None] = [None, *itertools.product((8, 16, 32), (64, 256))]
        grid = itertools.product((32, 64), (2, 4), (2, 3, 4))
        launches = [DecodeLaunch(n, w, s) for n, w, s in grid]
    else:
        shapes, policies, launches = [(2, 40)], [None, (4, 16)], [DecodeLaunch(16, 4, 1)]
    kv = _cache(max(b * -(-c // BLOCK) * BLOCK for b, c in shapes), dtype, device, gen)
    sweep, work = Sweep(cuda), {}
    for batch, ctx in shapes:
        shape = f"b{batch}x{ctx}"
        width = -(-max(ctx, CAPACITY_LIMIT) // BLOCK)
        tables = _tables(batch, -(-ctx // BLOCK), width, kv.shape[0], gen)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, HEADS, DIM, generator=gen, device=device).to(dtype)
        out = torch.empty_like(q)
        work[shape] = batch * ctx * KV_HEADS * DIM * 2 * kv.element_size()
        for policy, launch in itertools.product(policies, launches):
            splits, floor = policy or (-(-width * BLOCK // 256), 256)
            name = AttentionTuning(splits, floor, launch).decode_name
            if policy is None:  # the capacity grid's split count depends on the context limit
                name = f"capacity/{launch.name}"
            args = (q, kv, tables, lens, SCALE, 0, splits, floor, launch, out)
            sweep.time(name, shape, functools.partial(pa.paged_decode, *args))
        print(f"decode {shape}: best {sweep.best(shape) * 1e3:.1f} us", flush=True)
    return sweep.report(DEFAULT.decode_name, work, copy)


def prefill_sweep(cuda: bool, dtype: torch.dtype, device: torch.device, mm: float) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(1)
    if cuda:
        shapes = [(0, 2048), (0, 8192), (6144, 2048)]  # (cached prefix, new tokens)
        grid = itertools.product((64, 128), (64, 128), (4, 8), (2, 3))
        launches = [PrefillLaunch(m, n, w, s) for m, n, w, s in grid]
    else:
        shapes, launches = (
            [(0, 40), (24, 16)],
            [PrefillLaunch(16, 16, 4, 1), PrefillLaunch(32, 16, 4, 1)],
        )
    kv = _cache(max(p + n for p, n in shapes) + BLOCK, dtype, device, gen)
    sweep, work = Sweep(cuda), {}
    for prefix, n in shapes:
        shape = f"p{prefix}+{n}"
        per_row = -(-(prefix + n) // BLOCK)
        tables = _tables(1, per_row, per_row, kv.shape[0], gen)
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        starts = torch.tensor([prefix], dtype=torch.int32, device=device)
        q = torch.randn(n, HEADS, DIM, generator=gen, device=device).to(dtype)
        out = torch.empty_like(q)
        pairs = n * prefix + n * (n + 1) // 2  # (query, key) pairs a causal chunk attends
        work[shape] = 4.0 * DIM * HEADS * pairs
        for launch in launches:
            args = (q, kv, tables, cu, starts, n, SCALE, 0, launch, out)
            sweep.time(launch.name, shape, functools.partial(pa.paged_prefill, *args))
        best = sweep.best(shape)
        print(
            f"prefill {shape}: best {best * 1e3:.0f} us, {work[shape] / best / 1e9:.0f} TFLOP/s", flush=True
        )
    return sweep.report(DEFAULT.prefill.name, work, mm)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for attention_kernels.json")
    p.add_argument("--dry-run", action="store_true", help="a tiny sweep on the CPU (interpreter)")
    p.add_argument("--only", choices=("decode", "prefill"), help="one kernel's sweep")
    args = p.parse_args(argv)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (--dry-run runs the CPU rehearsal)"}))
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)"}
    report["copy_gbs"] = memory_copy_bandwidth(device, mib=2048 if cuda else 64) / 1e9
    report["matmul_tflops"] = matmul_flops(device, dtype, n=8192 if cuda else 256)["matmul"] / 1e12
    path = Path(args.out) / "attention_kernels.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for kernel in ("decode", "prefill"):
        if args.only in (None, kernel):
            if kernel == "decode":
                report["decode"] = decode_sweep(cuda, dtype, device, report["copy_gbs"] * 1e9)
            else:
                report["prefill"] = prefill_sweep(cuda, dtype, device, report["matmul_tflops"] * 1e12)
            path.write_text(json.dumps(report, indent=1))  # a lease ending midway keeps the first
    report["wall_s"] = time.perf_counter() - t0
    path.write_text(json.dumps(report, indent=1))
    summary = {k: v for k, v in report.items() if k not in ("decode", "prefill")}
    for kernel in ("decode", "prefill"):
        if kernel in report:
            r = report[kernel]
            summary[kernel] = {k: r[k] for k in ("best_of_ceiling", "default_rank", "default_score")}
            summary[kernel]["top"] = r["ranked"][:3]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
