"""Decode attention's split and launch settings, swept on a GPU.

Times the paged decode kernels (split + merge) alone, for one layer of a Llama-3.1-8B shape (32
query heads, 8 KV heads, dimension 128, bf16, 16-token blocks scattered through the cache), at
batch x context shapes from one short row to many long ones, over:

* split policies ``(num_splits, min_split_tokens)`` (``backend.DECODE_SPLITS`` and
  ``DECODE_MIN_SPLIT_TOKENS``), and the earlier grid sized to the block table's capacity (a
  split per 256 positions of an 8k limit: ``capacity``);
* launch settings (``DecodeLaunch``: positions a tile, warps, pipeline stages).

Each setting's time is a CUDA graph's replay (no launch gaps), its bandwidth the KV bytes the
rows attend to over that time, and the ceiling the device copy bandwidth measured in the same
run. Settings are ranked by the geometric mean over shapes of their time over the shape's best.

Run: ``python -m benchmarks.decode_attention [--out DIR]`` (``$OUT`` when set); ``--dry-run``
runs a tiny sweep under Triton's interpreter on the CPU (its numbers mean nothing).
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
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import median_time, memory_copy_bandwidth
from pdserve.model_runtime.kernels import paged_attention as pa
from pdserve.model_runtime.kv_cache.tensors import new_kv_cache

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
CAPACITY_LIMIT = 8192 + 64  # the GPU check's context limit: the capacity grid's width


def _time(fn: Any, cuda: bool) -> float:
    """Median seconds of ``fn``: replays of a CUDA graph of 10 ms of calls on a GPU."""
    if not cuda:
        return median_time(fn, repeat=2, warmup=1)
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=10, return_mode="median")) / 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for decode_attention.json")
    p.add_argument("--dry-run", action="store_true", help="a tiny sweep on the CPU (interpreter)")
    args = p.parse_args(argv)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (--dry-run runs the CPU rehearsal)"}))
        return 0
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        shapes = [(1, 1024), (64, 1024), (256, 1024), (16, 8192), (1, 32768)]
        policies: list[tuple[int, int] | None] = [None, *itertools.product((8, 16, 32), (64, 256))]
        launches = [pa.DecodeLaunch(n, w, s) for n, w, s in itertools.product((32, 64), (2, 4), (2, 3, 4))]
    else:
        shapes, policies, launches = [(2, 40)], [None, (4, 16)], [pa.DecodeLaunch(16, 4, 1)]
    t0 = time.perf_counter()
    copy = memory_copy_bandwidth(device, mib=2048 if cuda else 64)
    tokens = max(b * -(-c // BLOCK) * BLOCK for b, c in shapes)
    blocks = tokens // BLOCK + 1
    cache = new_kv_cache((1, blocks, 2, BLOCK, KV_HEADS, DIM), dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    cache.normal_(generator=gen)
    kv = cache[0]
    results: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    for batch, ctx in shapes:
        shape = f"b{batch}x{ctx}"
        width = -(-max(ctx, CAPACITY_LIMIT) // BLOCK)
        used = batch * -(-ctx // BLOCK)
        perm = torch.randperm(blocks - 1, generator=gen, device=device)[:used].to(torch.int32) + 1
        tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
        tables[:, : used // batch] = perm.view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, HEADS, DIM, generator=gen, device=device).to(dtype)
        out = torch.empty_like(q)
        kv_bytes = batch * ctx * KV_HEADS * DIM * 2 * kv.element_size()
        for policy, launch in itertools.product(policies, launches):
            splits, floor = policy or (-(-width * BLOCK // 256), 256)
            label = "capacity" if policy is None else f"s{splits}_m{floor}"
            name = f"{label}/n{launch.block_n}w{launch.num_warps}s{launch.num_stages}"
            call = functools.partial(
                pa.paged_decode, q, kv, tables, lens, 0.088, 0, splits, floor, launch, out
            )
            try:
                seconds = _time(call, cuda)
            except Exception as e:  # a setting the device cannot compile (shared memory) is skipped
                errors[name] = f"{type(e).__name__}: {e}"[:300]
                continue
            results.setdefault(name, {})[shape] = seconds * 1e3
        best = min((r[shape] for r in results.values() if shape in r), default=math.nan)
        print(f"{shape}: best {best * 1e3:.1f} us, {kv_bytes / (best / 1e3) / copy:.2f} of copy", flush=True)
    names = [f"b{b}x{c}" for b, c in shapes]
    complete = {k: v for k, v in results.items() if all(s in v for s in names)}
    best_of = {s: min(v[s] for v in complete.values()) for s in names}
    score = {
        k: math.exp(sum(math.log(v[s] / best_of[s]) for s in names) / len(names)) for k, v in complete.items()
    }
    ranked = sorted(score, key=score.__getitem__)
    for k in ranked[:10]:
        print(f"{score[k]:.3f} {k} " + " ".join(f"{complete[k][s] * 1e3:.0f}" for s in names), flush=True)
    report = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
        "copy_gbs": copy / 1e9,
        "shapes": names,
        "best_us": {s: best_of[s] * 1e3 for s in names},
        "ranked": [[k, score[k]] for k in ranked],
        "ms": complete,
        "errors": errors,
        "wall_s": time.perf_counter() - t0,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_attention.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("gpu", "copy_gbs", "best_us", "wall_s")} | {"top": ranked[:3]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
