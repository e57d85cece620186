"""What a prefill step of a size never seen before costs on CPU, in memory and in time, for each
way the engine can multiply: ``onednn`` as it runs (rows padded to a few buckets, each made when
the model loads: ``model/linear.py``), ``onednn_exact`` with every row count as it comes (what
it did before: one cached oneDNN primitive per size, made at first sight), and ``transposed``
(``torch.addmm``, which keeps no per-shape state).

Each mode runs in a process of its own (oneDNN's caches are per process), one thread, the
same model (``--model``, default SmolLM2-135M): a warm-up, then ``--sizes`` prefill steps of
distinct random lengths from 16 to ``--max-len`` (one request each, prefix cache off), then as
many of other lengths, then the first ones again. Reported: RSS growth over the first pass and
over the second (``rss_growth_warm_mib``: what new sizes still cost once a worker has run for a
while), the prefill rate of the third pass (tokens/s: thread CPU time, so a busy host counts
less) and its MFU against the best large-matmul FLOP/s measured in the same process right
before (the ceiling).

    .venv/bin/python -m benchmarks.linear_shapes            # about 8 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("onednn", "onednn_exact", "transposed")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_mode(mode: str, model: str, sizes: int, max_len: int, seed: int) -> dict[str, Any]:
    """One mode, in this process: the figures of the module docstring."""
    import os

    os.environ["PDSERVE_LINEAR"] = "transposed" if mode == "transposed" else "onednn"
    import torch

    from benchmarks.common import matmul_flops
    from benchmarks.engine_roofline import prefill_flops
    from pdserve.decode_worker.offline import OfflineDriver
    from pdserve.model_runtime.config import CacheConfig, EngineConfig
    from pdserve.model_runtime.model import linear
    from pdserve.model_runtime.model.llama import LlamaModel
    from pdserve.model_runtime.sampling_params import SamplingParams
    from pdserve.model_runtime.scheduler.plan import SchedulerConfig

    torch.set_num_threads(1)
    if mode == "onednn_exact":  # every row count reaches oneDNN as it is, first met in traffic
        linear.padded_rows = lambda rows: rows
        LlamaModel.warm_up = lambda self, max_step_tokens, max_step_rows: 0  # type: ignore[method-assign]
    engine = OfflineDriver(
        EngineConfig(
            model=model,
            device="cpu",
            cache=CacheConfig(block_size=16, num_blocks=max_len // 16 + 8, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_len, max_num_seqs=1),
        )
    )
    vocab = engine.model_config.vocab_size
    rng = random.Random(seed)
    drawn = rng.sample(range(16, max_len + 1), 2 * sizes)
    lengths, others = drawn[:sizes], drawn[sizes:]
    params = SamplingParams(max_tokens=1, temperature=0)

    def prefill(n: int) -> float:
        engine.add_request("r", [rng.randrange(3, vocab) for _ in range(n)], params)
        t0 = time.thread_time()
        while engine.has_unfinished:
            engine.step()
        return time.thread_time() - t0

    with torch.inference_mode():
        for n in (17, 33, 100):  # warm-up: the allocator and the code paths, not the sizes
            prefill(n)
        before = rss_mib()
        for n in lengths:
            prefill(n)
        grown = rss_mib() - before
        for n in others:
            prefill(n)
        grown_warm = rss_mib() - before - grown
        ceiling = max(matmul_flops(torch.device("cpu"), torch.float32).values())
        seconds = sum(prefill(n) for n in lengths)
    flops = sum(prefill_flops(engine.model_config, n) for n in lengths)
    return {
        "mode": mode,
        "rss_growth_mib": round(grown, 1),
        "rss_mib_per_size": round(grown / sizes, 2),
        "rss_growth_warm_mib": round(grown_warm, 1),
        "prefill_tok_s": round(sum(lengths) / seconds, 1),
        "prefill_mfu": round(flops / seconds / ceiling, 3),
        "matmul_best_gflops": round(ceiling / 1e9, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", type=int, default=48, help="distinct prompt lengths a pass (default 48)")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child: one mode, JSON out
    args = ap.parse_args()
    if args.max_len < 16 or not 1 <= 2 * args.sizes <= args.max_len - 15:
        ap.error("--sizes must be between 1 and (--max-len - 15) / 2, --max-len at least 16")
    if args.one:
        print(json.dumps(run_mode(args.one, args.model, args.sizes, args.max_len, args.seed)), flush=True)
        return
    rows: dict[str, Any] = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            ap.error(f"unknown mode {mode!r} (modes: {', '.join(MODES)})")
        cmd = [sys.executable, "-m", "benchmarks.linear_shapes", "--one", mode, "--model", args.model,
               "--sizes", str(args.sizes), "--max-len", str(args.max_len),
               "--seed", str(args.seed)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
        print(rows[mode], file=sys.stderr, flush=True)
    from benchmarks.common import emit

    base = rows.get("onednn_exact")
    if base is not None:
        for r in rows.values():
            r["tok_s_vs_exact"] = round(r["prefill_tok_s"] / base["prefill_tok_s"], 3)
    emit({"model": args.model, "sizes": args.sizes, "max_len": args.max_len, "modes": rows})


if __name__ == "__main__":
    main()
