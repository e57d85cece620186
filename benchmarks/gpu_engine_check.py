"""Prepared GPU check of the engine: one command, a few minutes on one GPU, everything the GPU
engine is judged by, with its ceilings measured in the same run.

1. Ceilings: device copy bandwidth (read + write) and bf16 matmul FLOP/s.
2. A Llama-3.1-8B-shaped model with random bf16 weights made on the device (speed does not
   depend on weight values; correctness is the tests' job), the ``paged`` backend, decode CUDA
   graphs captured up to 64 sequences.
3. Decode at a 1,024-token context, batch 1 and 64: CUDA graph replay time, a lone step's wall
   time (packing, one upload, replay, sampling, one copy back: ``decode_b1_step_ms``), the
   decode engine's own loop with overlapped steps (plan, launch, read, deltas: per step,
   ``decode_b1_engine_step_ms``) and MBU = (weights + KV read per step) / replay time / copy
   bandwidth. ``host_overhead_ratio`` = the engine's step / replay at batch 1 (1.0: the host is
   hidden behind the device); ``host_overhead_ratio_lone`` the same for a lone step.
4. Prefill of 2,048 and 8,192 fresh tokens: MFU against the bf16 matmul ceiling.
5. A profile of each workload: the kernels' table in ``profile.txt``, top shares in the JSON.
6. The KV hand-off over ``cuda_ipc`` (two processes, one GPU) for 1 to 128 blocks: the
   intercept of time against bytes is its fixed cost — from ``send`` of computed KV
   (``handoff_fixed_ms``), and from the last layer computed of a transfer begun beforehand, as a
   prefill worker begins it (``handoff_exposed_fixed_ms``).
7. The ``gpu``-marked tests (float32 token-exact with HF on CUDA, bf16 serving, the kernels on
   CUDA against their references, graphs against eager).

``--dry-run`` runs the same code on the CPU with a small model and the ``tcp`` hand-off (CI runs
it, so the script cannot rot between GPU loans); its numbers mean nothing.

Run: ``python -m benchmarks.gpu_engine_check [--out DIR]``. Writes ``DIR/gpu_engine_check.json``
(``$OUT`` when set) after every phase, so a lease that ends midway keeps what was measured; a
phase that fails records its error under ``errors`` and the next phases still run. The JSON is
printed as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import matmul_flops, memory_copy_bandwidth, sync
from benchmarks.engine_roofline import prefill_flops, weight_bytes
from pdserve.decode_worker.engine import DecodeEngine
from pdserve.model_runtime import attention_tuning
from pdserve.model_runtime.backend import Backend
from pdserve.model_runtime.config import ModelConfig
from pdserve.model_runtime.engine.model_runner import GraphSettings, ModelRunner
from pdserve.model_runtime.kv_cache.manager import KVCacheManager
from pdserve.model_runtime.kv_cache.tensors import kv_cache_shape, new_kv_cache
from pdserve.model_runtime.model.loader import random_model
from pdserve.model_runtime.presets import resolve_model
from pdserve.model_runtime.request import Request
from pdserve.model_runtime.sampling_params import SamplingParams
from pdserve.model_runtime.scheduler.plan import ScheduledChunk, SchedulerConfig
from pdserve.model_runtime.validation import RequestLimits
from pdserve.worker.messages import WorkerRole, WorkItem

ROOT = Path(__file__).resolve().parent.parent
LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
BLOCK = 16
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)


def _timed(fn: Any, device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn`` (device work included), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class _EngineRuntime:
    """What ``DecodeEngine`` needs of a worker's runtime, around the bench's runner."""

    kv: KVCacheManager
    runner: ModelRunner
    vocab_size: int
    max_model_len: int
    block_size: int = BLOCK
    eos_ids: frozenset[int] = frozenset()
    grammars: None = None  # no structured output

    def limits(self, max_prompt_tokens: int = 0, max_tokens_cap: int = 0) -> RequestLimits:
        return RequestLimits(self.vocab_size, self.max_model_len, BLOCK, self.kv.num_blocks)


class Bench:
    def __init__(
        self, config: ModelConfig, device: torch.device, dtype: torch.dtype, rows: int, ctx: int
    ) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.max_len = max(ctx + 64, 8192 + 64)
        self.per_seq = -(-(ctx + 64) // BLOCK)
        blocks = max(rows * self.per_seq, -(-self.max_len // BLOCK)) + 1
        model = random_model(config, device, dtype, self.max_len, Backend.PAGED)
        cache = new_kv_cache(kv_cache_shape(config, blocks, BLOCK), dtype, device)
        graphs = GraphSettings(rows, self.max_len, capture=device.type == "cuda")
        self.runner = ModelRunner(config, model, blocks, BLOCK, kv_cache=cache, graphs=graphs)
        self.blocks = blocks

    def decode(self, batch: int, ctx: int, repeat: int) -> dict[str, float]:
        """Replay (or, without graphs, the fixed-shape forward) and whole-step times, MBU inputs."""
        tables = [tuple(range(1 + i * self.per_seq, 1 + (i + 1) * self.per_seq)) for i in range(batch)]
        chunks = [ScheduledChunk(f"d{i}", (7,), ctx, tables[i], sample=True) for i in range(batch)]
        requests = {c.request_id: Request(c.request_id, (7,) * ctx, GREEDY) for c in chunks}
        runner, graphs = self.runner, self.runner.graphs
        assert graphs is not None and graphs.fits(chunks)
        step = _timed(lambda: runner.execute(chunks, requests), self.device, repeat)
        bucket = min(b for b in graphs.buckets if b >= batch)
        if graphs.graphs:
            replay = _timed(graphs.graphs[bucket].replay, self.device, repeat)
        else:
            replay = _timed(lambda: graphs._forward(bucket), self.device, repeat)
        dtype_bytes = torch.finfo(self.dtype).bits // 8
        read = weight_bytes(self.config, dtype_bytes) + batch * ctx * self.config.kv_bytes_per_token(
            dtype_bytes
        )
        return {"replay_ms": replay * 1e3, "step_ms": step * 1e3, "bytes_read": float(read)}

    def engine_step(self, batch: int, ctx: int, steps: int) -> float:
        """Seconds per step of ``DecodeEngine``'s loop over ``batch`` requests at ``ctx`` tokens,
        overlapped (each step planned and launched before the last one's tokens are read)."""
        kv = KVCacheManager(self.blocks, BLOCK, enable_prefix_caching=False)
        rt = _EngineRuntime(kv, self.runner, self.config.vocab_size, self.max_len)
        sched = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=batch)
        eng = DecodeEngine(rt, None, sched, "bench", WorkerRole.COLOCATED, overlap=True)
        warm = 4
        params = SamplingParams(max_tokens=warm + steps + 4, temperature=0, ignore_eos=True)
        for i in range(batch):
            eng.add_local(WorkItem(f"e{i}", tuple(3 + (i + j) % 1000 for j in range(ctx)), params))
        while eng.scheduler.prefill.num_waiting or eng.scheduler.prefill.num_running:
            eng.step()  # the prompts (not timed)
        for _ in range(warm):
            eng.step()
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync(self.device)
        elapsed = time.perf_counter() - t0
        while eng.has_work:
            eng.step()
        assert eng.idle and kv.stats().used == 0
        return elapsed / steps

    def prefill(self, n: int, repeat: int) -> float:
        table = tuple(range(1, 1 + -(-n // BLOCK)))
        chunk = ScheduledChunk("p", tuple(range(3, 3 + n)), 0, table, sample=True)
        requests = {"p": Request("p", chunk.token_ids, GREEDY)}
        return _timed(lambda: self.runner.execute([chunk], requests), self.device, repeat)


def _profile(bench: Bench, ctx: int, big: int, prefill_n: int, path: Path) -> dict[str, Any]:
    """Where each measured workload's device time goes (or host time on the CPU): the kernels'
    table in ``path``, the top five kernels' shares in the JSON. Timings under the profiler are
    not the measurement; the shares say what to fix next."""
    from torch.profiler import ProfilerActivity, profile

    cuda = bench.device.type == "cuda"
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    workloads: dict[str, Callable[[], object]] = {
        "decode_b1": lambda: bench.decode(1, ctx, 3),
        f"decode_b{big}": lambda: bench.decode(big, ctx, 3),
        f"prefill_{prefill_n}": lambda: bench.prefill(prefill_n, 1),
    }
    summary: dict[str, Any] = {}
    with path.open("w") as f:
        for name, fn in workloads.items():
            fn()  # compiled and captured outside the profile
            with profile(activities=activities) as prof:
                fn()
                sync(bench.device)
            averages = prof.key_averages()
            # on a GPU the kernels alone: an operator's own device time repeats its kernels'
            events = [
                e
                for e in averages
                if getattr(e, key) > 0 and (not cuda or str(getattr(e, "device_type", "")).endswith("CUDA"))
            ]
            total = sum(getattr(e, key) for e in events) or 1.0
            events.sort(key=lambda e: getattr(e, key), reverse=True)
            summary[name] = [[e.key[:100], round(getattr(e, key) / total, 4), e.count] for e in events[:5]]
            table = averages.table(sort_by=key, row_limit=30, max_name_column_width=90)
            f.write(f"== {name}\n{table}\n")
    return summary


def best_tuning(sweep: dict[str, Any]) -> attention_tuning.AttentionTuning:
    """The best-ranked settings of an ``attention_kernels`` report (the capacity grid, which
    depends on the context limit, is not a setting the engine takes)."""
    decode = next(name for name, _ in sweep["decode"]["ranked"] if not name.startswith("capacity/"))
    return attention_tuning.AttentionTuning.from_names(decode, sweep["prefill"]["ranked"][0][0])


def _handoff(backend: str, device: int | str, counts: tuple[int, ...]) -> dict[str, Any]:
    from benchmarks.gpu_kvtransfer import fixed_cost_ms, run

    result = run(backend, device, device, counts)
    fixed, per_mib = fixed_cost_ms(result["by_blocks_ms"], result["block_bytes"])
    exposed, _ = fixed_cost_ms(result["exposed_by_blocks_ms"], result["block_bytes"])
    return {
        "handoff_fixed_ms": fixed,
        "handoff_exposed_fixed_ms": exposed,
        "handoff_ms_per_mib": per_mib,
        "handoff": result,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_engine_check.json")
    p.add_argument("--dry-run", action="store_true", help="the same code on the CPU, small sizes")
    p.add_argument("--skip-tests", action="store_true", help="leave out the gpu-marked tests")
    p.add_argument("--skip-handoff", action="store_true", help="leave out the KV hand-off")
    p.add_argument(
        "--tuning-from",
        type=Path,
        help="attention_kernels.json of a sweep: run with its best decode and prefill settings",
    )
    args = p.parse_args(argv)
    if args.tuning_from is not None:
        attention_tuning.use(best_tuning(json.loads(args.tuning_from.read_text())))
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (--dry-run runs the CPU rehearsal)"}))
        return 0
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    config = resolve_model("tiny").model_config() if dry else ModelConfig.from_hf(LLAMA_31_8B, "llama-3.1-8b")
    ctx, big, repeat = (64, 4, 3) if dry else (1024, 64, 20)
    prefills = (64, 128) if dry else (2048, 8192)
    out: dict[str, Any] = {
        "gpu": "cpu (dry run)" if dry else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "model": "tiny" if dry else "llama-3.1-8b shape, random bf16",
        "context": ctx,
        "tuning": {
            "decode": attention_tuning.current().decode_name,
            "prefill": attention_tuning.current().prefill.name,
        },
    }
    report = Report(Path(args.out) / "gpu_engine_check.json", out)
    t0 = time.perf_counter()
    ceil: dict[str, float] = {}

    def ceilings() -> None:
        ceil["copy"] = memory_copy_bandwidth(device, mib=64 if dry else 2048)
        ceil["mm"] = matmul_flops(device, dtype, n=256 if dry else 8192)["matmul"]
        out.update(copy_gbs=ceil["copy"] / 1e9, matmul_tflops=ceil["mm"] / 1e12)
        print(
            f"ceilings: copy {out['copy_gbs']:.0f} GB/s, matmul {out['matmul_tflops']:.1f} TFLOP/s",
            flush=True,
        )

    measured = report.phase("ceilings", ceilings)  # without them no ratio: the engine phases wait
    benches: list[Bench] = []

    def setup() -> None:
        benches.append(Bench(config, device, dtype, big, ctx))
        out["setup_s"] = time.perf_counter() - t0

    if measured and report.phase("setup", setup):
        bench = benches[0]
        for batch in (1, big):
            key = "b1" if batch == 1 else "b64" if not dry else f"b{batch}"
            mbu_key = f"decode_mbu_{'b64' if batch == big else 'b1'}"

            def decode(batch: int = batch, key: str = key, mbu_key: str = mbu_key) -> None:
                d = bench.decode(batch, ctx, repeat)
                out[f"decode_{key}_replay_ms"], out[f"decode_{key}_step_ms"] = d["replay_ms"], d["step_ms"]
                out[mbu_key] = mbu = d["bytes_read"] / (d["replay_ms"] / 1e3) / ceil["copy"]
                print(
                    f"decode batch {batch}: replay {d['replay_ms']:.2f} ms, lone step {d['step_ms']:.2f} ms, "
                    f"MBU {mbu:.2f}",
                    flush=True,
                )

            def engine(batch: int = batch, key: str = key) -> None:
                ms = out[f"decode_{key}_engine_step_ms"] = bench.engine_step(batch, ctx, repeat) * 1e3
                print(f"decode batch {batch}: engine step (overlapped) {ms:.2f} ms", flush=True)

            report.phase(f"decode_{key}", decode)
            report.phase(f"engine_{key}", engine)
        if "decode_b1_replay_ms" in out:
            if "decode_b1_engine_step_ms" in out:
                out["host_overhead_ratio"] = out["decode_b1_engine_step_ms"] / out["decode_b1_replay_ms"]
            out["host_overhead_ratio_lone"] = out["decode_b1_step_ms"] / out["decode_b1_replay_ms"]
        for n, key in zip(prefills, ("2k", "8k"), strict=True):

            def prefill(n: int = n, key: str = key) -> None:
                t = bench.prefill(n, max(3, repeat // 4))
                mfu = prefill_flops(config, n) / t / ceil["mm"]
                out[f"prefill_{key}_ms"], out[f"prefill_mfu_{key}"] = t * 1e3, mfu
                print(f"prefill {n}: {t * 1e3:.1f} ms, MFU {mfu:.2f}", flush=True)

            report.phase(f"prefill_{key}", prefill)

        def where() -> None:
            out["profile"] = _profile(bench, ctx, big, prefills[-1], Path(args.out) / "profile.txt")

        report.phase("profile", where)
        del bench
    benches.clear()
    if device.type == "cuda":
        try:  # the hand-off's processes need the memory (a poisoned context raises here too)
            torch.cuda.empty_cache()
        except Exception as e:
            out.setdefault("errors", {})["empty_cache"] = f"{type(e).__name__}: {e}"[:2000]
    counts = (1, 4) if dry else (1, 4, 16, 64, 128)

    def handoff() -> None:
        out.update(_handoff("tcp" if dry else "cuda_ipc", "cpu" if dry else 0, counts))
        print(f"hand-off fixed cost {out['handoff_fixed_ms']:.3f} ms", flush=True)
        if not out["handoff"].get("byte_exact"):
            raise AssertionError("the hand-off's blocks arrived changed (hashes differ)")

    if not args.skip_handoff:
        report.phase("handoff", handoff)
    rc = 0
    if not (dry or args.skip_tests):

        def gpu_tests() -> None:
            tests = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/engine/test_gpu.py"],
                cwd=ROOT,
                timeout=300,
            )
            out["gpu_tests_rc"] = tests.returncode

        report.phase("gpu_tests", gpu_tests)
        rc = int(out.get("gpu_tests_rc", 1))
    return report.finish(t0, rc if "errors" not in out else 1)


class Report:
    """The run's results, written after every phase: a lease that ends (or a phase that fails)
    midway still leaves what was measured, and each failure's error under ``errors``."""

    def __init__(self, path: Path, out: dict[str, Any]) -> None:
        self.path, self.out = path, out
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()  # the GPU's name and versions, whatever happens next

    def phase(self, name: str, fn: Callable[[], None]) -> bool:
        try:
            fn()
            ok = True
        except Exception as e:  # the next phase may still measure something
            traceback.print_exc()
            self.out.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            ok = False
        self.write()
        return ok

    def write(self) -> None:
        """Atomically: a run cut off mid-write leaves the previous phase's file, not half of one."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.out, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def finish(self, t0: float, rc: int) -> int:
        self.out["wall_s"] = time.perf_counter() - t0
        self.write()
        print(json.dumps(self.out, sort_keys=True))
        return rc


if __name__ == "__main__":
    sys.exit(main())
